{{/* Chart name. */}}
{{- define "dra-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name of the release's objects. */}}
{{- define "dra-agent.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "dra-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dra-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dra-agent.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "dra-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dra-agent
{{- end -}}

{{- define "dra-agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dra-agent.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* key=value settings of one backend, sorted by key. */}}
{{- define "dra-agent.settings" -}}
{{- $parts := list -}}
{{- range $key := keys . | sortAlpha -}}
{{- $parts = append $parts (printf "%s=%v" $key (index $ $key)) -}}
{{- end -}}
{{- join "," $parts -}}
{{- end -}}

{{/* The --backend value: NAME:key=value,... per enabled backend, separated by ';'. */}}
{{- define "dra-agent.backends" -}}
{{- $specs := list -}}
{{- with .Values.backends.nvidia -}}
{{- if .enabled -}}
{{- $settings := merge (dict "driver" .driverName "driver-root" .driverRoot "host-root" "/host") (deepCopy .settings) -}}
{{- $specs = append $specs (printf "nvidia:%s" (include "dra-agent.settings" $settings)) -}}
{{- end -}}
{{- end -}}
{{- with .Values.backends.amd -}}
{{- if .enabled -}}
{{- $settings := merge (dict "driver" .driverName) (deepCopy .settings) -}}
{{- $specs = append $specs (printf "amd:%s" (include "dra-agent.settings" $settings)) -}}
{{- end -}}
{{- end -}}
{{- with .Values.backends.fake -}}
{{- if .enabled -}}
{{- $settings := deepCopy .settings -}}
{{- if .driverName -}}{{- $_ := set $settings "driver" .driverName -}}{{- end -}}
{{- $spec := "fake" -}}
{{- if $settings -}}{{- $spec = printf "fake:%s" (include "dra-agent.settings" $settings) -}}{{- end -}}
{{- $specs = append $specs $spec -}}
{{- end -}}
{{- end -}}
{{- join ";" $specs -}}
{{- end -}}

{{/* The DeviceClasses to create: a list of {name, driver, type}. */}}
{{- define "dra-agent.deviceClasses" -}}
{{- $classes := list -}}
{{- range $vendor := list "nvidia" "amd" -}}
{{- $backend := index $.Values.backends $vendor -}}
{{- if $backend.enabled -}}
{{- range $backend.deviceClasses -}}
{{- $classes = append $classes (dict "name" .name "driver" $backend.driverName "type" (default "" .type)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range .Values.deviceClasses.extra -}}
{{- $classes = append $classes (dict "name" .name "driver" .driver "type" (default "" .type)) -}}
{{- end -}}
{{- toJson (dict "items" $classes) -}}
{{- end -}}

{{/* The DRA driver names the agent serves, as a CEL list literal (the fake backend's built-in
profiles use gpu.nvidia.com and gpu.amd.com unless backends.fake.driverName is set). */}}
{{- define "dra-agent.driverNamesCel" -}}
{{- $names := list -}}
{{- if .Values.backends.nvidia.enabled -}}{{- $names = append $names .Values.backends.nvidia.driverName -}}{{- end -}}
{{- if .Values.backends.amd.enabled -}}{{- $names = append $names .Values.backends.amd.driverName -}}{{- end -}}
{{- with .Values.backends.fake -}}
{{- if .enabled -}}
{{- if .driverName -}}
{{- $names = append $names .driverName -}}
{{- else -}}
{{- $names = concat $names (list "gpu.nvidia.com" "gpu.amd.com") -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $quoted := list -}}
{{- range $names | uniq -}}{{- $quoted = append $quoted (printf "'%s'" .) -}}{{- end -}}
[{{ join ", " $quoted }}]
{{- end -}}
