"""The Kubernetes operator (Kopf): LoRAAdapter and ServingPool custom resources.

Modules: `crds` (the one source of the CRDs), `specs` (typed specs with defaults), `adapters`
and `pools` (handlers per resource kind), `registry` (startup settings, handler registry),
pure helpers (`manifests`, `autoscaling`, `conditions`), and the I/O they use (`sources`,
`ingestion`, `catalog`, `kube`, `basemodels`). Runs in its own process: `loraplane operator`.
"""
