{{/* Names, labels and values every template shares. */}}

{{- define "slipstream.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "slipstream.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The nodes' pods (the StatefulSet and the Services that select them). */}}
{{- define "slipstream.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: node
{{- end -}}

{{- define "slipstream.etcdSelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: etcd
{{- end -}}

{{- define "slipstream.secretName" -}}
{{- .Values.cluster.existingSecret | default (printf "%s-tokens" (include "slipstream.fullname" .)) -}}
{{- end -}}

{{- define "slipstream.etcdName" -}}
{{- printf "%s-etcd" (include "slipstream.fullname" .) -}}
{{- end -}}

{{/* etcd://host:port[,host:port...]: the bundled members by their stable DNS names, or the given endpoints. */}}
{{- define "slipstream.etcdUrl" -}}
{{- $scheme := ternary "etcds" "etcd" (.Values.tls.etcd | default false) -}}
{{- if and .Values.tls.etcd .Values.etcd.bundled -}}
{{- fail "tls.etcd: the bundled etcd speaks plain HTTP; set etcd.bundled=false and list etcd.endpoints of an etcd with TLS" -}}
{{- end -}}
{{- if and .Values.tls.etcd (not .Values.tls.secretName) -}}
{{- fail "tls.etcd: needs tls.secretName (the certificate shown to etcd)" -}}
{{- end -}}
{{- if .Values.etcd.bundled -}}
{{- $name := include "slipstream.etcdName" . -}}
{{- $members := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $members = append $members (printf "%s-%d.%s.%s.svc:2379" $name $i $name $.Release.Namespace) -}}
{{- end -}}
{{- printf "etcd://%s" (join "," $members) -}}
{{- else -}}
{{- if not .Values.etcd.endpoints -}}
{{- fail "etcd.endpoints: list your etcd's host:port endpoints, or set etcd.bundled=true" -}}
{{- end -}}
{{- printf "%s://%s" $scheme (join "," .Values.etcd.endpoints) -}}
{{- end -}}
{{- end -}}

{{- define "slipstream.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
