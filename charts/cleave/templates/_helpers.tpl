{{/*
Chart name, truncated to 63 characters (the DNS label limit for names and label values).
*/}}
{{- define "cleave.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified name for the chart's own resources: "<release>-<name>", or just the release
name when it already contains the chart name.
*/}}
{{- define "cleave.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
"name-version" for the helm.sh/chart label.
*/}}
{{- define "cleave.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels of the operator pod. The component "operator" keeps them disjoint from the
pods the operator creates (component prefill|decode|router|redis, managed-by cleave-operator).
*/}}
{{- define "cleave.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cleave.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Common labels of every resource this chart creates.
*/}}
{{- define "cleave.labels" -}}
helm.sh/chart: {{ include "cleave.chart" . }}
{{ include "cleave.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cleave
{{- end }}

{{/*
The operator's ServiceAccount name.
*/}}
{{- define "cleave.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "cleave.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator image reference; the tag defaults to the chart's appVersion.
*/}}
{{- define "cleave.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}
