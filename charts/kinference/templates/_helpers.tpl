{{/* Labels of every operator object (as manifests/ sets them). */}}
{{- define "kinference.labels" -}}
app.kubernetes.io/name: kinference-operator
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: kinference
{{- end }}

{{- define "kinference.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
The operator's permissions, one list for the ClusterRole and for the
namespaced Role; manifests/rbac.yaml says why each rule is there. The
operator can only grant an EPP's Role what it holds itself.
*/}}
{{- define "kinference.rules" -}}
- apiGroups: [kinference.io]
  resources: [inferencepolicies]
  verbs: [get, list, watch]
- apiGroups: [kinference.io]
  resources: [inferencepolicies/status]
  verbs: [patch]
- apiGroups: [kinference.io]
  resources: [inferencepolicies/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [list, watch, create, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [list, watch, create, patch]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [list, watch, create, patch]
# Granted on to each EPP, which reads its requests' priorities.
- apiGroups: [inference.networking.x-k8s.io]
  resources: [inferenceobjectives]
  verbs: [list, watch]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes, backendtlspolicies]
  verbs: [list, watch, create, patch, delete]
- apiGroups: [gateway.networking.k8s.io]
  resources: [gateways]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end }}
