package deployments

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	monv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/santhosh-tekuri/jsonschema/v6"
	"github.com/spiegel-nats/spiegel/pkg/events"
	"github.com/spiegel-nats/spiegel/pkg/passwords"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// The Kubernetes manifests are rendered with kustomize (krusty, the library behind `kubectl
// apply -k`), then every object is decoded strictly into its k8s.io/api Go type: unknown or
// duplicate fields, a field of the wrong case or type, or a malformed quantity fail. Those Go
// types are what the API server's OpenAPI schemas are generated from, pinned by go.mod, so
// nothing is downloaded at test time. KEDA's ScaledObject is not a core type: it is validated
// against schemas/keda.sh_v1alpha1_scaledobject.json, written from KEDA's CRD; the Prometheus
// Operator's PodMonitor and PrometheusRule (component kubernetes/monitoring) are decoded strictly
// into the operator's own Go types, from which its CRDs are generated. Semantic checks
// follow: probes, ports, resources, security context, and every SPIEGEL_* variable checked
// against pkg/config (config.Load must accept the rendered environment).

const namespace = "spiegel"

// rendered is one kustomization's output, decoded.
type rendered struct {
	deployments  map[string]*appsv1.Deployment
	jobs         map[string]*batchv1.Job
	pdbs         map[string]*policyv1.PodDisruptionBudget
	services     map[string]*corev1.Service
	configMaps   map[string]*corev1.ConfigMap
	secrets      map[string]*corev1.Secret
	namespaces   map[string]*corev1.Namespace
	hpas         map[string]*autoscalingv2.HorizontalPodAutoscaler
	scaledObject map[string]*scaledObject

	podMonitors     map[string]*monv1.PodMonitor
	prometheusRules map[string]*monv1.PrometheusRule
}

// scaledObject is the part of a KEDA ScaledObject the semantic checks read (the schema checks
// the whole object).
type scaledObject struct {
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
	} `json:"metadata"`
	Spec struct {
		ScaleTargetRef struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Name       string `json:"name"`
		} `json:"scaleTargetRef"`
		MinReplicaCount *int32 `json:"minReplicaCount"`
		MaxReplicaCount *int32 `json:"maxReplicaCount"`
		Triggers        []struct {
			Type     string            `json:"type"`
			Metadata map[string]string `json:"metadata"`
		} `json:"triggers"`
	} `json:"spec"`
}

func render(t *testing.T, dir string) *rendered {
	t.Helper()
	return renderFS(t, filesys.MakeFsOnDisk(), dir)
}

// renderFS renders the kustomization in dir of fs.
func renderFS(t *testing.T, fs filesys.FileSystem, dir string) *rendered {
	t.Helper()
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(fs, dir)
	require.NoError(t, err, "kustomize build %s", dir)
	r := &rendered{
		deployments: map[string]*appsv1.Deployment{}, jobs: map[string]*batchv1.Job{},
		pdbs: map[string]*policyv1.PodDisruptionBudget{}, services: map[string]*corev1.Service{},
		configMaps: map[string]*corev1.ConfigMap{}, secrets: map[string]*corev1.Secret{},
		namespaces: map[string]*corev1.Namespace{}, hpas: map[string]*autoscalingv2.HorizontalPodAutoscaler{},
		scaledObject: map[string]*scaledObject{},
		podMonitors:  map[string]*monv1.PodMonitor{}, prometheusRules: map[string]*monv1.PrometheusRule{},
	}
	keda := kedaSchema(t)
	for _, res := range m.Resources() {
		data, err := res.MarshalJSON()
		require.NoError(t, err)
		gvk := res.GetApiVersion() + " " + res.GetKind()
		name := res.GetName()
		where := fmt.Sprintf("%s: %s %s", dir, gvk, name)
		if gvk != "v1 Namespace" {
			assert.Equal(t, namespace, res.GetNamespace(), "%s: namespace", where)
		}
		switch gvk {
		case "apps/v1 Deployment":
			r.deployments[name] = strict[appsv1.Deployment](t, where, data)
		case "batch/v1 Job":
			r.jobs[name] = strict[batchv1.Job](t, where, data)
		case "policy/v1 PodDisruptionBudget":
			r.pdbs[name] = strict[policyv1.PodDisruptionBudget](t, where, data)
		case "v1 Service":
			r.services[name] = strict[corev1.Service](t, where, data)
		case "v1 ConfigMap":
			r.configMaps[name] = strict[corev1.ConfigMap](t, where, data)
		case "v1 Secret":
			r.secrets[name] = strict[corev1.Secret](t, where, data)
		case "v1 Namespace":
			r.namespaces[name] = strict[corev1.Namespace](t, where, data)
		case "autoscaling/v2 HorizontalPodAutoscaler":
			r.hpas[name] = strict[autoscalingv2.HorizontalPodAutoscaler](t, where, data)
		case "keda.sh/v1alpha1 ScaledObject":
			doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(data))
			require.NoError(t, err)
			require.NoError(t, keda.Validate(doc), "%s: against the KEDA ScaledObject schema", where)
			var so scaledObject
			require.NoError(t, json.Unmarshal(data, &so))
			r.scaledObject[name] = &so
		case "monitoring.coreos.com/v1 PodMonitor":
			r.podMonitors[name] = strict[monv1.PodMonitor](t, where, data)
		case "monitoring.coreos.com/v1 PrometheusRule":
			r.prometheusRules[name] = strict[monv1.PrometheusRule](t, where, data)
		default:
			t.Fatalf("%s: no schema for this kind: add one to the test", where)
		}
	}
	return r
}

// strict decodes data into a T the way the API server does (case-sensitive field names), and
// fails on unknown or duplicate fields, which the API server would drop or reject.
func strict[T any](t *testing.T, where string, data []byte) *T {
	t.Helper()
	var v T
	strictErrs, err := kjson.UnmarshalStrict(data, &v, kjson.DisallowDuplicateFields, kjson.DisallowUnknownFields)
	require.NoError(t, err, where)
	require.Empty(t, strictErrs, where)
	return &v
}

func kedaSchema(t *testing.T) *jsonschema.Schema {
	t.Helper()
	const file = "schemas/keda.sh_v1alpha1_scaledobject.json"
	f, err := os.Open(file)
	require.NoError(t, err)
	defer f.Close()
	doc, err := jsonschema.UnmarshalJSON(f)
	require.NoError(t, err)
	c := jsonschema.NewCompiler()
	require.NoError(t, c.AddResource(file, doc))
	sch, err := c.Compile(file)
	require.NoError(t, err)
	return sch
}

// The default kustomization: the base plus KEDA ScaledObjects.
func TestKubernetesKEDA(t *testing.T) {
	r := render(t, "kubernetes")
	checkBase(t, r)
	assert.Empty(t, r.hpas, "KEDA creates the HPAs itself: none of ours may target the same Deployments")
	prefix := r.configMaps["spiegel-config"].Data["SPIEGEL_SUBJECT_PREFIX"]
	natsURL, err := url.Parse(strings.Split(r.configMaps["spiegel-config"].Data["SPIEGEL_NATS_URL"], ",")[0])
	require.NoError(t, err)
	groups := map[string]events.Group{"replicator": events.GroupReplicate, "onchange": events.GroupOnChange}
	for bin, g := range groups {
		so, ok := r.scaledObject[bin]
		require.True(t, ok, "a ScaledObject scales %s", bin)
		assert.Equal(t, bin, so.Spec.ScaleTargetRef.Name)
		assert.Contains(t, r.deployments, so.Spec.ScaleTargetRef.Name)
		require.NotNil(t, so.Spec.MinReplicaCount)
		assert.GreaterOrEqual(t, *so.Spec.MinReplicaCount, int32(2), "%s: two at least, for availability", bin)
		require.NotNil(t, so.Spec.MaxReplicaCount)
		assert.Greater(t, *so.Spec.MaxReplicaCount, *so.Spec.MinReplicaCount)
		require.Len(t, so.Spec.Triggers, 1)
		tr := so.Spec.Triggers[0]
		assert.Equal(t, "nats-jetstream", tr.Type)
		// KEDA's nats-jetstream scaler metadata.
		known := map[string]bool{"natsServerMonitoringEndpoint": true, "account": true, "stream": true,
			"consumer": true, "lagThreshold": true, "activationLagThreshold": true, "useHttps": true}
		for k := range tr.Metadata {
			assert.True(t, known[k], "%s: unknown nats-jetstream metadata %q", bin, k)
		}
		for _, k := range []string{"natsServerMonitoringEndpoint", "account", "stream", "consumer", "lagThreshold"} {
			assert.NotEmpty(t, tr.Metadata[k], "%s: nats-jetstream needs %s", bin, k)
		}
		assert.Equal(t, events.NewSubjects(prefix).WorkStream(), tr.Metadata["stream"], "%s: the work stream", bin)
		assert.Equal(t, g.ConsumerName(), tr.Metadata["consumer"], "%s: its durable consumer", bin)
		assert.Equal(t, natsURL.Hostname()+":8222", tr.Metadata["natsServerMonitoringEndpoint"],
			"%s: the monitoring port of the NATS in SPIEGEL_NATS_URL", bin)
		assert.Regexp(t, `^[1-9][0-9]*$`, tr.Metadata["lagThreshold"])
	}
	assert.Len(t, r.scaledObject, len(groups))
}

// The alternative: autoscaling/v2 HPAs on the external metric spiegel_jobs_pending{group}.
func TestKubernetesHPA(t *testing.T) {
	r := render(t, "kubernetes/hpa")
	checkBase(t, r)
	assert.Empty(t, r.scaledObject)
	metricsSrc, err := os.ReadFile("../pkg/metrics/consumer.go")
	require.NoError(t, err)
	groups := map[string]events.Group{"replicator": events.GroupReplicate, "onchange": events.GroupOnChange}
	for bin, g := range groups {
		h, ok := r.hpas[bin]
		require.True(t, ok, "an HPA scales %s", bin)
		assert.Equal(t, "apps/v1", h.Spec.ScaleTargetRef.APIVersion)
		assert.Equal(t, "Deployment", h.Spec.ScaleTargetRef.Kind)
		assert.Contains(t, r.deployments, h.Spec.ScaleTargetRef.Name)
		require.NotNil(t, h.Spec.MinReplicas)
		assert.GreaterOrEqual(t, *h.Spec.MinReplicas, int32(2))
		assert.Greater(t, h.Spec.MaxReplicas, *h.Spec.MinReplicas)
		require.Len(t, h.Spec.Metrics, 1)
		m := h.Spec.Metrics[0]
		require.Equal(t, autoscalingv2.ExternalMetricSourceType, m.Type)
		require.NotNil(t, m.External)
		assert.Equal(t, "spiegel_jobs_pending", m.External.Metric.Name)
		assert.Contains(t, string(metricsSrc), `"`+m.External.Metric.Name+`"`, "the metric exists in pkg/metrics")
		require.NotNil(t, m.External.Metric.Selector)
		assert.Equal(t, string(g), m.External.Metric.Selector.MatchLabels["group"])
		assert.Equal(t, autoscalingv2.AverageValueMetricType, m.External.Target.Type,
			"AverageValue: replicas = pending / target")
		require.NotNil(t, m.External.Target.AverageValue)
		assert.Positive(t, m.External.Target.AverageValue.Value())
	}
	assert.Len(t, r.hpas, len(groups))
}

// checkBase checks what both kustomizations share.
func checkBase(t *testing.T, r *rendered) {
	t.Helper()
	require.Contains(t, r.namespaces, namespace)
	cm, ok := r.configMaps["spiegel-config"]
	require.True(t, ok)
	assert.Equal(t, "3", cm.Data["SPIEGEL_STREAM_REPLICAS"], "replicated streams on a NATS cluster")
	sec, ok := r.secrets["spiegel"]
	require.True(t, ok)
	require.Contains(t, sec.StringData, "passwords.json")
	dir := t.TempDir()
	pwFile := filepath.Join(dir, "passwords.json")
	require.NoError(t, os.WriteFile(pwFile, []byte(sec.StringData["passwords.json"]), 0o600))
	_, err := passwords.Load(pwFile)
	require.NoError(t, err, "the Secret's passwords.json is a valid passwords file")

	var image string
	pods := map[string]corev1.PodTemplateSpec{}
	for name, d := range r.deployments {
		pods["Deployment "+name] = d.Spec.Template
		require.NotNil(t, d.Spec.Selector)
		for k, v := range d.Spec.Selector.MatchLabels {
			assert.Equal(t, v, d.Spec.Template.Labels[k], "%s: the selector matches the pods", name)
		}
		require.NotNil(t, d.Spec.Replicas)
		assert.GreaterOrEqual(t, *d.Spec.Replicas, int32(2), "%s: two of each", name)
		// A PodDisruptionBudget that selects the pods and lets a drain go on.
		var pdb *policyv1.PodDisruptionBudget
		for _, p := range r.pdbs {
			if p.Spec.Selector != nil && matches(p.Spec.Selector.MatchLabels, d.Spec.Template.Labels) {
				require.Nil(t, pdb, "%s: one PodDisruptionBudget", name)
				pdb = p
			}
		}
		require.NotNil(t, pdb, "%s: a PodDisruptionBudget", name)
		if pdb.Spec.MinAvailable != nil {
			assert.Less(t, pdb.Spec.MinAvailable.IntValue(), int(*d.Spec.Replicas), "%s: a drain can evict one", name)
		} else {
			require.NotNil(t, pdb.Spec.MaxUnavailable, name)
			assert.GreaterOrEqual(t, pdb.Spec.MaxUnavailable.IntValue(), 1)
		}
	}
	for _, bin := range binaries {
		assert.Contains(t, r.deployments, bin, "a Deployment runs %s", bin)
	}
	assert.Len(t, r.pdbs, len(r.deployments))
	install, ok := r.jobs["spiegel-install"]
	require.True(t, ok, "a Job runs producer install")
	pods["Job spiegel-install"] = install.Spec.Template
	assert.Contains(t, []corev1.RestartPolicy{corev1.RestartPolicyOnFailure, corev1.RestartPolicyNever},
		install.Spec.Template.Spec.RestartPolicy)

	for where, tmpl := range pods {
		ps := tmpl.Spec
		require.Len(t, ps.Containers, 1, where)
		c := ps.Containers[0]
		bin := binaryOf(t, c.Command)
		isJob := strings.HasPrefix(where, "Job")
		if isJob {
			assert.Equal(t, []string{"/usr/local/bin/producer", "install"}, c.Command)
		} else {
			assert.Len(t, c.Command, 1, where)
			assert.Empty(t, c.Args, where)
		}
		if image == "" {
			image = c.Image
		}
		assert.Equal(t, image, c.Image, "%s: one image for all binaries", where)
		assert.NotEqual(t, "spiegel", c.Image, "%s: kustomize's images: transformer sets the image", where)

		// Hardened: non-root, read-only root, no privilege escalation, no capabilities, no token.
		require.NotNil(t, ps.SecurityContext, where)
		require.NotNil(t, ps.SecurityContext.RunAsNonRoot, where)
		assert.True(t, *ps.SecurityContext.RunAsNonRoot, where)
		if u := ps.SecurityContext.RunAsUser; u != nil {
			assert.NotZero(t, *u, where)
		}
		require.NotNil(t, ps.SecurityContext.SeccompProfile, where)
		assert.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, ps.SecurityContext.SeccompProfile.Type)
		require.NotNil(t, ps.AutomountServiceAccountToken, where)
		assert.False(t, *ps.AutomountServiceAccountToken, "%s: needs no Kubernetes API token", where)
		sc := c.SecurityContext
		require.NotNil(t, sc, where)
		require.NotNil(t, sc.AllowPrivilegeEscalation, where)
		assert.False(t, *sc.AllowPrivilegeEscalation, where)
		require.NotNil(t, sc.ReadOnlyRootFilesystem, where)
		assert.True(t, *sc.ReadOnlyRootFilesystem, where)
		require.NotNil(t, sc.Capabilities, where)
		assert.Equal(t, []corev1.Capability{"ALL"}, sc.Capabilities.Drop, where)
		assert.Empty(t, sc.Capabilities.Add, where)
		assert.Nil(t, sc.Privileged, where)

		// Resources: requests for the scheduler, a memory limit.
		for _, res := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			req, ok := c.Resources.Requests[res]
			require.True(t, ok, "%s: requests %s", where, res)
			lim, ok := c.Resources.Limits[res]
			require.True(t, ok, "%s: limits %s", where, res)
			assert.LessOrEqual(t, req.Cmp(lim), 0, "%s: %s request above its limit", where, res)
		}

		// The environment: real variables only, accepted by config.Load.
		env := map[string]string{}
		for _, from := range c.EnvFrom {
			require.NotNil(t, from.ConfigMapRef, "%s: envFrom ConfigMaps only (secrets by key)", where)
			m, ok := r.configMaps[from.ConfigMapRef.Name]
			require.True(t, ok, "%s: ConfigMap %s exists", where, from.ConfigMapRef.Name)
			for k, v := range m.Data {
				env[from.Prefix+k] = v
			}
		}
		for _, e := range c.Env {
			switch {
			case e.ValueFrom == nil:
				env[e.Name] = e.Value
			case e.ValueFrom.SecretKeyRef != nil:
				ref := e.ValueFrom.SecretKeyRef
				s, ok := r.secrets[ref.Name]
				require.True(t, ok, "%s: Secret %s exists", where, ref.Name)
				v, ok := s.StringData[ref.Key]
				require.True(t, ok, "%s: Secret %s has %s", where, ref.Name, ref.Key)
				env[e.Name] = v
			default:
				t.Fatalf("%s: %s: unexpected valueFrom", where, e.Name)
			}
		}
		files := map[string]string{}
		if f, ok := env["SPIEGEL_PASSWORDS_FILE"]; ok {
			assert.Equal(t, "passwords.json", secretFileKey(t, where, ps, c, f, "spiegel"),
				"%s: SPIEGEL_PASSWORDS_FILE is the Secret's passwords.json", where)
			files[f] = pwFile
		}
		checkEnv(t, where, bin, env, files)
		if isJob {
			continue
		}

		// Probes on the port the binary listens on.
		port := defaultPort(t, bin)
		if a, ok := env["SPIEGEL_HTTP_ADDR"]; ok {
			port = portOf(t, a)
		}
		require.Len(t, c.Ports, 1, where)
		assert.Equal(t, int32(port), c.Ports[0].ContainerPort, "%s: containerPort is SPIEGEL_HTTP_ADDR's", where)
		for probe, p := range map[string]*corev1.Probe{"/healthz": c.LivenessProbe, "/readyz": c.ReadinessProbe} {
			require.NotNil(t, p, "%s: %s probe", where, probe)
			require.NotNil(t, p.HTTPGet, where)
			assert.Equal(t, probe, p.HTTPGet.Path, where)
			pp := p.HTTPGet.Port.IntValue()
			if p.HTTPGet.Port.StrVal != "" {
				assert.Equal(t, c.Ports[0].Name, p.HTTPGet.Port.StrVal, "%s: %s probe names the port", where, probe)
				pp = int(c.Ports[0].ContainerPort)
			}
			assert.Equal(t, port, pp, "%s: %s probe port", where, probe)
		}
		assert.Equal(t, fmt.Sprint(port), tmpl.Annotations["prometheus.io/port"], "%s: scrape port", where)
		// SIGTERM: Kubernetes must wait longer than the binary's own shutdown grace.
		require.NotNil(t, ps.TerminationGracePeriodSeconds, where)
		grace := shutdownGrace(t, bin, env)
		assert.Greater(t, float64(*ps.TerminationGracePeriodSeconds), grace.Seconds(),
			"%s: terminationGracePeriodSeconds above SPIEGEL_SHUTDOWN_GRACE", where)
	}

	// Services select pods of a Deployment and target a named port they have.
	for name, s := range r.services {
		var d *appsv1.Deployment
		for _, dd := range r.deployments {
			if matches(s.Spec.Selector, dd.Spec.Template.Labels) {
				d = dd
			}
		}
		require.NotNil(t, d, "Service %s selects a Deployment's pods", name)
		for _, p := range s.Spec.Ports {
			assert.Equal(t, d.Spec.Template.Spec.Containers[0].Ports[0].Name, p.TargetPort.StrVal, "Service %s", name)
		}
	}
}

// secretFileKey returns the key of Secret secretName that file is, in the container c of ps.
func secretFileKey(t *testing.T, where string, ps corev1.PodSpec, c corev1.Container, file, secretName string) string {
	t.Helper()
	for _, m := range c.VolumeMounts {
		rel, err := filepath.Rel(m.MountPath, file)
		if err != nil || strings.HasPrefix(rel, "..") {
			continue
		}
		assert.True(t, m.ReadOnly, "%s: the secret is mounted read-only", where)
		assert.Empty(t, m.SubPath, "%s: no subPath, so a changed Secret reaches the pod", where)
		for _, v := range ps.Volumes {
			if v.Name != m.Name || v.Secret == nil || v.Secret.SecretName != secretName {
				continue
			}
			require.NotNil(t, v.Secret.DefaultMode, where)
			assert.Equal(t, int32(0o440), *v.Secret.DefaultMode, "%s: secret files not world-readable", where)
			if len(v.Secret.Items) == 0 {
				return rel
			}
			for _, it := range v.Secret.Items {
				if it.Path == rel {
					return it.Key
				}
			}
		}
	}
	t.Fatalf("%s: %s is not in a volume of Secret %s", where, file, secretName)
	return ""
}

func matches(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}
