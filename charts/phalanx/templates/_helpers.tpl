{{/* Names and labels shared by every template of the chart. */}}

{{- define "phalanx.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-phalanx, or just the release name when it already contains "phalanx". */}}
{{- define "phalanx.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "phalanx.operatorName" -}}
{{- printf "%s-operator" (include "phalanx.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "phalanx.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "phalanx.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "phalanx.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Selector labels: stable across upgrades (a Deployment's selector is immutable). */}}
{{- define "phalanx.selectorLabels" -}}
app.kubernetes.io/name: {{ include "phalanx.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels of every object: the app.kubernetes.io/* recommended set. `component` is passed in. */}}
{{- define "phalanx.labels" -}}
app.kubernetes.io/name: {{ include "phalanx.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: phalanx
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The Secret holding the metrics token: the one named in values, else <fullname>-metrics-token (made by the operator when missing). */}}
{{- define "phalanx.metricsTokenSecret" -}}
{{- default (printf "%s-metrics-token" (include "phalanx.fullname" .)) .Values.podMonitor.authorization.secretName -}}
{{- end -}}

{{/* The Secret of the CA that signs every master's certificate (operator.masterTLS). */}}
{{- define "phalanx.caSecret" -}}
{{- default (printf "%s-ca" (include "phalanx.fullname" .)) .Values.operator.masterTLS.caSecret -}}
{{- end }}

{{/* The namespaces the operator handles (operator.watchNamespace and operator.watchNamespaces, each once), as
a JSON list; empty: every namespace. */}}
{{- define "phalanx.watchNamespaces" -}}
{{- concat (list .Values.operator.watchNamespace) (.Values.operator.watchNamespaces | default list) | compact | uniq | toJson -}}
{{- end -}}
