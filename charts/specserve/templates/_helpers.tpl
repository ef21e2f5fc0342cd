{{/* The chart's name, overridable. */}}
{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name: the prefix of every object the chart creates. */}}
{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "specserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specserve
{{- end -}}

{{- define "specserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "specserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "specserve.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The default engine image (engines.image); empty when no repository is set. */}}
{{- define "specserve.engineImage" -}}
{{- with .Values.engines.image -}}
{{- if and .repository .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else if .repository -}}
{{- printf "%s:%s" .repository (default $.Chart.AppVersion .tag) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* True ("true") when the cluster serves the Prometheus Operator's API. */}}
{{- define "specserve.monitoringApi" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- end -}}

{{/* A map as "k1=v1,k2=v2" (sorted), the format of the operator's SPECSERVE_SERVICEMONITOR_LABELS. */}}
{{- define "specserve.keyValues" -}}
{{- $pairs := list -}}
{{- range $key := keys . | sortAlpha -}}
{{- $pairs = append $pairs (printf "%s=%s" $key (get $ $key)) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}
