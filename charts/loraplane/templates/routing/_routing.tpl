{{/*
Helpers for running behind the llm-d router (Gateway API Inference Extension) and for KEDA.
*/}}

{{/* A pool entry's namespace: (list $ pool). */}}
{{- define "loraplane.pool.namespace" -}}
{{- $ := index . 0 }}
{{- default $.Release.Namespace (index . 1).namespace }}
{{- end }}

{{/* Namespaces the pool companions go to: the release's and every listed pool's. */}}
{{- define "loraplane.pool.namespaces" -}}
{{- $namespaces := list .Release.Namespace }}
{{- range .Values.pools }}
{{- $namespaces = append $namespaces (include "loraplane.pool.namespace" (list $ .)) }}
{{- end }}
{{- uniq $namespaces | join "," }}
{{- end }}

{{/*
The llm-d router's EndpointPickerConfig: the vLLM metrics source (by default the replicas'
gateway-metrics port, 8003, whose vllm:lora_requests_info names their adapters; the API port
never does) and extractor, then the queue-depth, KV-cache and prefix-cache scorers of llm-d's
default profile plus the LoRA affinity scorer (prefer a replica whose GPU holds the request's
adapter, then one with a free slot).
*/}}
{{- define "loraplane.eppConfig" -}}
{{- $picker := .Values.routing.endpointPicker -}}
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: metrics-data-source
    parameters:
      scheme: http
      path: /metrics
      {{- with $picker.metricsPort }}
      port: {{ . }}
      {{- end }}
  - type: core-metrics-extractor
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: prefix-cache-scorer
  - type: lora-affinity-scorer
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
        weight: {{ $picker.weights.queue }}
      - pluginRef: kv-cache-utilization-scorer
        weight: {{ $picker.weights.kvCache }}
      - pluginRef: prefix-cache-scorer
        weight: {{ $picker.weights.prefixCache }}
      - pluginRef: lora-affinity-scorer
        weight: {{ $picker.weights.loraAffinity }}
{{- end }}

{{/*
A KEDA prometheus query: (list namespace pool signal perReplica). The pool's pressure summed
over its replicas' fresh reports, as the operator exports it; while no replica reported
recently, its current replicas times the target, so KEDA holds the count as the operator would.
*/}}
{{- define "loraplane.keda.query" -}}
{{- $selector := printf "pool_namespace=%q,pool=%q" (index . 0) (index . 1) }}
{{- printf "max(loraplane_pool_pressure{%s,signal=%q}) or (max(loraplane_pool_replicas{%s}) * %v)" $selector (index . 2) $selector (index . 3) }}
{{- end }}
