{{/* Names and labels. */}}
{{- define "pagedserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagedserve.labels" -}}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pagedserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/*
Grace period: kubelet counts the preStop sleep against it, so it must cover preStop + drain.
An explicit value that is too short fails the install instead of cutting in-flight requests.
*/}}
{{- define "pagedserve.terminationGracePeriodSeconds" -}}
{{- $needed := add .Values.lifecycle.preStopSleepSeconds .Values.server.shutdownTimeout -}}
{{- $given := .Values.lifecycle.terminationGracePeriodSeconds -}}
{{- if kindIs "invalid" $given -}}
{{- add $needed 15 -}}
{{- else if lt (int $given) (int $needed) -}}
{{- fail (printf "lifecycle.terminationGracePeriodSeconds (%d) must be >= lifecycle.preStopSleepSeconds + server.shutdownTimeout (%d)" (int $given) (int $needed)) -}}
{{- else -}}
{{- $given -}}
{{- end -}}
{{- end -}}

{{/*
Flags the chart sets itself, each from the value named here. The server's parser lets the last
occurrence win and accepts unique abbreviations (`--shutdown=300`), so the same flag in
server.extraArgs would silently break what the chart derives from the value: the grace period
(shutdownTimeout), the GPU limit (tensorParallelSize), the ports of probes and Service.
*/}}
{{- define "pagedserve.checkExtraArgs" -}}
{{- $owned := dict "model" "model.path" "served-model-name" "model.servedModelName" "port" "server.grpcPort" "http-port" "server.httpPort" "tensor-parallel-size" "server.tensorParallelSize" "shutdown-timeout" "server.shutdownTimeout" "ssl-certfile" "tls.secretName" "ssl-keyfile" "tls.secretName" "ssl-ca-certs" "tls.clientAuth" -}}
{{- range $arg := .Values.server.extraArgs -}}
{{- $name := regexReplaceAll "=.*" (trimPrefix "--" $arg) "" -}}
{{- if and (hasPrefix "--" $arg) $name -}}
{{- range $flag, $value := $owned -}}
{{- if hasPrefix $name $flag -}}
{{- fail (printf "server.extraArgs: %q overrides --%s, which the chart passes from %s: set %s instead" $arg $flag $value $value) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The server binds each port once. In KServe's RawDeployment Service the first container port (gRPC)
becomes port 80 and the HTTP port keeps its number, so an HTTP port 80 would give the Service two
ports 80: KServe fails to create it and the InferenceService never becomes ready.
*/}}
{{- define "pagedserve.checkPorts" -}}
{{- $grpc := int .Values.server.grpcPort -}}
{{- $http := int .Values.server.httpPort -}}
{{- if eq $grpc $http -}}
{{- fail (printf "server.grpcPort and server.httpPort are both %d: the server needs two ports" $grpc) -}}
{{- end -}}
{{- if and (eq .Values.mode "kserve") (eq $http 80) -}}
{{- fail "server.httpPort: 80 is taken in kserve mode: KServe's predictor Service maps the gRPC port to port 80" -}}
{{- end -}}
{{- end -}}

{{/*
TLS: the Secret's files where the server and the probes read them. Deployment mode only: KServe's
runtime port is named h2c (cleartext gRPC) and its ingress or mesh terminates TLS.
*/}}
{{- define "pagedserve.tlsDir" -}}/etc/pagedserve/tls{{- end -}}

{{- define "pagedserve.checkTls" -}}
{{- if and .Values.tls.clientAuth (not .Values.tls.secretName) -}}
{{- fail "tls.clientAuth needs tls.secretName: the Secret's ca.crt is what client certificates are checked against" -}}
{{- end -}}
{{- if and .Values.tls.secretName (eq .Values.mode "kserve") -}}
{{- fail "tls.secretName is for deployment mode: in kserve mode KServe's ingress or mesh terminates TLS" -}}
{{- end -}}
{{- end -}}

{{/*
`pagedserve serve` flags after the image's ENTRYPOINT. Arguments: (dict "root" $ "model" PATH "name" NAME).
*/}}
{{- define "pagedserve.args" -}}
{{- $v := .root.Values -}}
{{- include "pagedserve.checkExtraArgs" .root -}}
{{- include "pagedserve.checkPorts" .root -}}
{{- include "pagedserve.checkTls" .root -}}
{{- /* every value quoted: a name with ": " or " #" would read as YAML, not as the argument */}}
- {{ printf "--model=%s" .model | quote }}
- {{ printf "--served-model-name=%s" .name | quote }}
- {{ printf "--port=%v" $v.server.grpcPort | quote }}
- {{ printf "--http-port=%v" $v.server.httpPort | quote }}
- {{ printf "--tensor-parallel-size=%v" $v.server.tensorParallelSize | quote }}
- {{ printf "--shutdown-timeout=%v" $v.server.shutdownTimeout | quote }}
{{- if $v.tls.secretName }}
{{- $dir := include "pagedserve.tlsDir" .root }}
- {{ printf "--ssl-certfile=%s/tls.crt" $dir | quote }}
- {{ printf "--ssl-keyfile=%s/tls.key" $dir | quote }}
{{- if $v.tls.clientAuth }}
- {{ printf "--ssl-ca-certs=%s/ca.crt" $dir | quote }}
{{- end }}
{{- end }}
{{- range $v.server.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{- define "pagedserve.env" -}}
{{- if ne .Values.compileCache.volume "none" }}
- name: TORCH_EXTENSIONS_DIR
  value: {{ printf "%s/torch_extensions" .Values.compileCache.mountPath | quote }}
- name: TORCHINDUCTOR_CACHE_DIR
  value: {{ printf "%s/inductor" .Values.compileCache.mountPath | quote }}
{{- end }}
{{- if .Values.tracing.otlpEndpoint }}
- name: PAGEDSERVE_OTLP_TRACES_ENDPOINT
  value: {{ .Values.tracing.otlpEndpoint | quote }}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* GPU limit = tensor-parallel size (one GPU per rank), on top of the user's resources. */}}
{{- define "pagedserve.resources" -}}
{{- $resources := deepCopy .Values.resources -}}
{{- if .Values.gpu.enabled -}}
{{- $limits := $resources.limits | default dict -}}
{{- $_ := set $limits .Values.gpu.resourceName (int .Values.server.tensorParallelSize) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{- define "pagedserve.probes" -}}
{{- $ready := "pagedserve.rpc.v1.Generation" -}}
startupProbe:
  {{- include "pagedserve.probeAction" (dict "root" . "service" $ready "probe" .Values.probes.startup) | nindent 2 }}
  {{- toYaml .Values.probes.startup | nindent 2 }}
readinessProbe:
  {{- include "pagedserve.probeAction" (dict "root" . "service" $ready "probe" .Values.probes.readiness) | nindent 2 }}
  {{- toYaml .Values.probes.readiness | nindent 2 }}
livenessProbe:
  {{- include "pagedserve.probeAction" (dict "root" . "service" "" "probe" .Values.probes.liveness) | nindent 2 }}
  {{- toYaml .Values.probes.liveness | nindent 2 }}
{{- end -}}

{{/*
A probe's check of a grpc.health.v1 service: kubelet's own gRPC probe, or with TLS (which kubelet's
gRPC probes do not speak) `pagedserve health` in the container, verifying the server's certificate
and, under mutual TLS, presenting the pod's own. Arguments: (dict "root" $ "service" NAME "probe" VALUES).
*/}}
{{- define "pagedserve.probeAction" -}}
{{- $v := .root.Values -}}
{{- $port := int $v.server.grpcPort -}}
{{- if $v.tls.secretName -}}
{{- $dir := include "pagedserve.tlsDir" .root -}}
{{- $serverName := $v.tls.serverName | default (printf "%s.%s.svc" (include "pagedserve.fullname" .root) .root.Release.Namespace) -}}
exec:
  command:
    - pagedserve
    - health
    - --address=127.0.0.1:{{ $port }}
    - --service={{ .service }}
    {{- /* a second under kubelet's own timeout, so a slow answer fails with the probe's message */}}
    - --timeout={{ max 1 (sub (int (.probe.timeoutSeconds | default 1)) 1) }}
    - --ssl-ca-certs={{ $dir }}/ca.crt
    - --ssl-target-name={{ $serverName }}
    {{- if $v.tls.clientAuth }}
    - --ssl-certfile={{ $dir }}/tls.crt
    - --ssl-keyfile={{ $dir }}/tls.key
    {{- end }}
{{- else -}}
grpc: {port: {{ $port }}, service: {{ .service | quote }}}
{{- end -}}
{{- end -}}

{{/* Everything the Deployment's container and the KServe runtime container share. */}}
{{- define "pagedserve.containerCommon" -}}
image: {{ include "pagedserve.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- with include "pagedserve.env" . }}
env:
{{- . | nindent 2 }}
{{- end }}
resources:
  {{- include "pagedserve.resources" . | nindent 2 }}
{{ include "pagedserve.probes" . }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .Values.lifecycle.preStopSleepSeconds }}"]
{{- with .Values.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "pagedserve.podVolumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.sharedMemory.sizeLimit }}
{{- include "pagedserve.compileCacheVolume" . }}
{{- end -}}

{{/* The build caches' volume (values.yaml: compileCache), listed after dshm; nothing for none. */}}
{{- define "pagedserve.compileCacheVolume" -}}
{{- with .Values.compileCache }}
{{- if eq .volume "emptyDir" }}
- name: compile-cache
  emptyDir:
    sizeLimit: {{ .sizeLimit }}
{{- else if eq .volume "pvc" }}
- name: compile-cache
  persistentVolumeClaim:
    claimName: {{ .claimName | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The container's mounts of dshm and the build caches' volume. */}}
{{- define "pagedserve.commonMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if ne .Values.compileCache.volume "none" }}
- name: compile-cache
  mountPath: {{ .Values.compileCache.mountPath | quote }}
{{- end }}
{{- end -}}
