{{/*
The one place the chart adds the `node` label (the scraped pod's node) to every series of the
agent; the Grafana dashboards and the alerts use it. The ServiceMonitor and the PodMonitor include
it; a Prometheus without the Operator needs the same relabeling (deploy/observability.md).
*/}}
{{- define "dra-agent.nodeRelabeling" -}}
- sourceLabels: [__meta_kubernetes_pod_node_name]
  targetLabel: node
{{- end }}
