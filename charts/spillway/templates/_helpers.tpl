{{/*
The chart's name, or nameOverride.
*/}}
{{- define "spillway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The name of the chart's objects: fullnameOverride, else the release name when
it already contains the chart's name, else "<release>-<chart>"; at most 63
characters.
*/}}
{{- define "spillway.fullname" -}}
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
{{- define "spillway.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The labels of every object.
*/}}
{{- define "spillway.labels" -}}
helm.sh/chart: {{ include "spillway.chart" . }}
{{ include "spillway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: spillway
{{- end }}

{{/*
The labels the Deployment selects its pods by, and the Service and the
PodDisruptionBudget select them by.
*/}}
{{- define "spillway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "spillway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller-manager
{{- end }}

{{/*
The manager's ServiceAccount.
*/}}
{{- define "spillway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "spillway.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The metrics port: 8443 over HTTPS, 8080 over plain HTTP.
*/}}
{{- define "spillway.metricsPort" -}}
{{- if .Values.metrics.secure }}8443{{ else }}8080{{ end }}
{{- end }}

{{/*
Where the Redis secrets are mounted in the manager's container.
*/}}
{{- define "spillway.redisSecretsDir" -}}/etc/spillway/redis{{- end }}
