{{/*
Names, labels, images and the environment the components share.
*/}}

{{- define "loraplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name (<= 50 characters, so suffixes like -controlplane fit 63). */}}
{{- define "loraplane.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "loraplane.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's labels (not part-of: the CRDs carry that themselves). */}}
{{- define "loraplane.releaseLabels" -}}
helm.sh/chart: {{ include "loraplane.chart" . }}
app.kubernetes.io/name: {{ include "loraplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "loraplane.labels" -}}
{{ include "loraplane.releaseLabels" . }}
app.kubernetes.io/part-of: loraplane
{{- end }}

{{/* Selector labels of one component: (list $ "controlplane"). They never change. */}}
{{- define "loraplane.selectorLabels" -}}
{{- $ := index . 0 -}}
app.kubernetes.io/name: {{ include "loraplane.name" $ }}
app.kubernetes.io/instance: {{ $.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Labels of one component's resources: (list $ "operator"). */}}
{{- define "loraplane.componentLabels" -}}
{{ include "loraplane.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "loraplane.controlplane.fullname" -}}
{{- printf "%s-controlplane" (include "loraplane.fullname" .) }}
{{- end }}

{{- define "loraplane.operator.fullname" -}}
{{- printf "%s-operator" (include "loraplane.fullname" .) }}
{{- end }}

{{- define "loraplane.controlplane.serviceAccountName" -}}
{{- if .Values.controlplane.serviceAccount.create }}
{{- default (include "loraplane.controlplane.fullname" .) .Values.controlplane.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.controlplane.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "loraplane.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "loraplane.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* A component's image: (list $ .Values.operator.image). A digest wins over a tag. */}}
{{- define "loraplane.image" -}}
{{- $ := index . 0 }}
{{- $override := index . 1 }}
{{- $repository := default $.Values.image.repository $override.repository }}
{{- $tag := default (default $.Chart.AppVersion $.Values.image.tag) $override.tag }}
{{- if and $.Values.image.digest (not $override.repository) (not $override.tag) }}
{{- printf "%s@%s" $repository $.Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}
{{- end }}

{{- define "loraplane.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The Secret holding the admin and service tokens. */}}
{{- define "loraplane.tokens.secretName" -}}
{{- default (printf "%s-tokens" (include "loraplane.fullname" .)) .Values.tokens.existingSecret }}
{{- end }}

{{/*
A token for the chart-made Secret: (list $ "admin-token" .Values.tokens.admin). The value if
given, else the one already in the cluster (upgrades keep it), else a new random one.
*/}}
{{- define "loraplane.tokens.value" -}}
{{- $ := index . 0 }}
{{- $key := index . 1 }}
{{- $given := index . 2 }}
{{- if $given }}
{{- $given }}
{{- else }}
{{- $existing := lookup "v1" "Secret" $.Release.Namespace (include "loraplane.tokens.secretName" $) }}
{{- if and $existing $existing.data (hasKey $existing.data $key) }}
{{- index $existing.data $key | b64dec }}
{{- else }}
{{- randAlphaNum 48 }}
{{- end }}
{{- end }}
{{- end }}

{{/* Whether the catalog is PostgreSQL (a URL or a Secret); otherwise SQLite. */}}
{{- define "loraplane.database.external" -}}
{{- if or .Values.database.url .Values.database.existingSecret }}true{{ end }}
{{- end }}

{{- define "loraplane.database.secretName" -}}
{{- default (printf "%s-database" (include "loraplane.fullname" .)) .Values.database.existingSecret }}
{{- end }}

{{- define "loraplane.database.secretKey" -}}
{{- if .Values.database.existingSecret }}{{ .Values.database.existingSecretKey }}{{ else }}database-url{{ end }}
{{- end }}

{{/* The Secret the migrations Job reads: the chart's own is a hook (it must exist before the
release's resources do). */}}
{{- define "loraplane.database.hookSecretName" -}}
{{- if .Values.database.existingSecret }}
{{- .Values.database.existingSecret }}
{{- else }}
{{- printf "%s-database-migrations" (include "loraplane.fullname" .) }}
{{- end }}
{{- end }}

{{- define "loraplane.store.isPath" -}}
{{- if not (hasPrefix "s3://" .Values.store.uri) }}true{{ end }}
{{- end }}

{{/* The control plane's internal port (`--internal-port`): the internal routes and /metrics
answer there only; its Service is <fullname>-controlplane-internal (docs/security.md). */}}
{{- define "loraplane.controlplane.internalPort" -}}
8081
{{- end }}

{{/* The URL the operator and the data plane call: the internal Service, unless overridden. */}}
{{- define "loraplane.controlplane.url" -}}
{{- default (printf "http://%s-internal.%s.svc:%s" (include "loraplane.controlplane.fullname" .) .Release.Namespace (include "loraplane.controlplane.internalPort" .)) .Values.operator.controlplaneUrl }}
{{- end }}

{{/* Labels of the data plane pods the operator creates (loraplane/operator/manifests.py). */}}
{{- define "loraplane.dataplane.podLabels" -}}
app.kubernetes.io/name: loraplane-dataplane
app.kubernetes.io/managed-by: loraplane-operator
{{- end }}

{{/* Namespaces holding ServingPools, for the NetworkPolicies. */}}
{{- define "loraplane.dataplane.namespaces" -}}
{{- toYaml (default (list .Release.Namespace) .Values.networkPolicy.dataplane.namespaces) }}
{{- end }}

{{/* LORAPLANE_ADMIN_TOKEN (the control plane's admin routes). */}}
{{- define "loraplane.env.adminToken" -}}
- name: LORAPLANE_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "loraplane.tokens.secretName" . }}
      key: {{ .Values.tokens.adminTokenKey }}
{{- end }}

{{/* LORAPLANE_SERVICE_TOKEN (the internal routes: the control plane checks it, the operator
calls them with it). */}}
{{- define "loraplane.env.serviceToken" -}}
- name: LORAPLANE_SERVICE_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "loraplane.tokens.secretName" . }}
      key: {{ .Values.tokens.serviceTokenKey }}
{{- end }}

{{/* LORAPLANE_* variables of the store, shared by the control plane and the operator. */}}
{{- define "loraplane.env.store" -}}
- name: LORAPLANE_STORE
  value: {{ .Values.store.uri | quote }}
{{- with .Values.store.s3.endpointUrl }}
- name: LORAPLANE_S3_ENDPOINT_URL
  value: {{ . | quote }}
{{- end }}
{{- with .Values.store.importBuckets }}
- name: LORAPLANE_IMPORT_BUCKETS
  value: {{ join "," . | quote }}
{{- end }}
{{- end }}

{{/* AWS credentials from a Secret, when one is named. */}}
{{- define "loraplane.envFrom.s3" -}}
{{- with .Values.store.s3.credentialsSecret }}
envFrom:
  - secretRef:
      name: {{ . }}
{{- end }}
{{- end }}

{{/* The store volume (a path store): the claim if given, else an emptyDir. */}}
{{- define "loraplane.volume.store" -}}
{{- if include "loraplane.store.isPath" . }}
- name: store
{{- if .Values.store.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.store.existingClaim }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
{{- end }}

{{- define "loraplane.volumeMount.store" -}}
{{- if include "loraplane.store.isPath" . }}
- name: store
  mountPath: {{ .Values.store.uri }}
{{- end }}
{{- end }}
