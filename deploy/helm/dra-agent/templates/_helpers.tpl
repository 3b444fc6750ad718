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
{{- if include "dra-agent.mixed" $ -}}{{- $_ := set $settings "optional" "true" -}}{{- end -}}
{{- $specs = append $specs (printf "nvidia:%s" (include "dra-agent.settings" $settings)) -}}
{{- end -}}
{{- end -}}
{{- with .Values.backends.amd -}}
{{- if .enabled -}}
{{- $settings := merge (dict "driver" .driverName) (deepCopy .settings) -}}
{{- if include "dra-agent.mixed" $ -}}{{- $_ := set $settings "optional" "true" -}}{{- end -}}
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
{{- $quoted := list -}}
{{- range (include "dra-agent.driverNames" . | fromJsonArray) -}}{{- $quoted = append $quoted (printf "'%s'" .) -}}{{- end -}}
[{{ join ", " $quoted }}]
{{- end -}}

{{/* The DRA driver names the agent serves, as a JSON list. */}}
{{- define "dra-agent.driverNames" -}}
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
{{- $names | uniq | toJson -}}
{{- end -}}

{{/* "true" when both vendor backends are enabled: one chart for a fleet of NVIDIA-only, AMD-only and mixed nodes. */}}
{{- define "dra-agent.mixed" -}}
{{- if and .Values.backends.nvidia.enabled .Values.backends.amd.enabled -}}true{{- end -}}
{{- end -}}

{{/* The hostPath type of a vendor driver root: in mixed mode a node may lack it, so the pod must still start. */}}
{{- define "dra-agent.driverRootType" -}}
{{- if include "dra-agent.mixed" . -}}DirectoryOrCreate{{- else -}}Directory{{- end -}}
{{- end -}}

{{/*
The taint policy as YAML, checked as the agent checks it (the agent exits 2 on a bad policy, so a
bad one fails here instead): `taintPolicy` is YAML text or a mapping with `severities` and `rules`.
*/}}
{{- define "dra-agent.taintPolicy" -}}
{{- $policy := .Values.taintPolicy -}}
{{- if kindIs "string" $policy -}}
{{- $policy = fromYaml $policy -}}
{{- if hasKey $policy "Error" -}}
{{- fail (printf "taintPolicy: not a YAML mapping (%s)" (get $policy "Error")) -}}
{{- end -}}
{{- end -}}
{{- $effects := list "NoSchedule" "NoExecute" "None" -}}
{{- range $key, $value := $policy -}}
{{- if not (has $key (list "rules" "severities")) -}}
{{- fail (printf "taintPolicy: unknown field %q: the agent accepts severities and rules (see the chart README)" $key) -}}
{{- end -}}
{{- end -}}
{{- with $policy.severities -}}
{{- if not (kindIs "map" .) -}}{{- fail "taintPolicy.severities: expected a mapping such as {info: ignore}" -}}{{- end -}}
{{- range $severity, $effect := . -}}
{{- if not (has $severity (list "critical" "warning" "info")) -}}
{{- fail (printf "taintPolicy.severities.%s: expected critical, warning or info" $severity) -}}
{{- end -}}
{{- if not (has $effect (append $effects "ignore")) -}}
{{- fail (printf "taintPolicy.severities.%s: %v: expected NoSchedule, NoExecute, None or ignore" $severity $effect) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with $policy.rules -}}
{{- if not (kindIs "slice" .) -}}{{- fail "taintPolicy.rules: expected a list of rules" -}}{{- end -}}
{{- range $i, $rule := . -}}
{{- if not (kindIs "map" $rule) -}}{{- fail (printf "taintPolicy.rules[%d]: expected a mapping such as {condition: xid, value: 79, effect: NoExecute}" $i) -}}{{- end -}}
{{- range $key, $_ := $rule -}}
{{- if not (has $key (list "condition" "driver" "value" "values" "effect" "ignore")) -}}
{{- fail (printf "taintPolicy.rules[%d].%s: unknown field: expected condition, driver, value, values, effect or ignore" $i $key) -}}
{{- end -}}
{{- end -}}
{{- if not $rule.condition -}}{{- fail (printf "taintPolicy.rules[%d].condition: required (a condition name such as xid)" $i) -}}{{- end -}}
{{- if eq (hasKey $rule "effect") (and (hasKey $rule "ignore") (eq (toString $rule.ignore) "true")) -}}
{{- fail (printf "taintPolicy.rules[%d]: expected exactly one of effect or ignore: true" $i) -}}
{{- end -}}
{{- if and (hasKey $rule "effect") (not (has $rule.effect $effects)) -}}
{{- fail (printf "taintPolicy.rules[%d].effect: %v: expected NoSchedule, NoExecute or None" $i $rule.effect) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- toYaml $policy -}}
{{- end -}}
