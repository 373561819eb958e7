"""Fleet-scale warming: `--shard auto` in Kubernetes Indexed Jobs, the example k8s manifests,
and N real warm processes into one S3 cache with a PostgreSQL index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from support.warming import TINY_MANIFEST, tiny  # noqa: E402

from cachectl.cli import cli
from cachectl.core.errors import BadInput
from cachectl.warm.sharding import resolve_shard

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "examples" / "k8s" / "warm-job.yaml"


# --------------------------------------------------------------------------- --shard auto


@pytest.mark.parametrize(
    ("env", "shards", "expected"),
    [
        ({"JOB_COMPLETION_INDEX": "0", "CACHECTL_SHARDS": "3"}, None, (1, 3)),
        ({"JOB_COMPLETION_INDEX": "2", "CACHECTL_SHARDS": "3"}, None, (3, 3)),
        ({"JOB_COMPLETION_INDEX": "1"}, 4, (2, 4)),
        ({"JOB_COMPLETION_INDEX": "1", "CACHECTL_SHARDS": "9"}, 2, (2, 2)),  # the flag wins
    ],
)
def test_shard_auto_from_indexed_job_env(
    env: dict[str, str], shards: int | None, expected: tuple[int, int]
) -> None:
    assert resolve_shard("auto", shards, env) == expected


def test_shard_explicit_and_absent() -> None:
    assert resolve_shard("2/5", None, {}) == (2, 5)
    assert resolve_shard(None, None, {"JOB_COMPLETION_INDEX": "1"}) is None


@pytest.mark.parametrize(
    ("env", "shards", "message"),
    [
        ({"CACHECTL_SHARDS": "3"}, None, "JOB_COMPLETION_INDEX is not set"),
        ({"JOB_COMPLETION_INDEX": "0"}, None, "no shard count"),
        (
            {"JOB_COMPLETION_INDEX": "3", "CACHECTL_SHARDS": "3"},
            None,
            "not below the shard count 3",
        ),
        ({"JOB_COMPLETION_INDEX": "x", "CACHECTL_SHARDS": "3"}, None, "must be a whole number"),
        ({"JOB_COMPLETION_INDEX": "0", "CACHECTL_SHARDS": "0"}, None, "CACHECTL_SHARDS must be"),
        ({"JOB_COMPLETION_INDEX": "0"}, 0, "--shards must be"),
    ],
)
def test_shard_auto_refusals(env: dict[str, str], shards: int | None, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        resolve_shard("auto", shards, env)


def test_shards_without_auto_is_refused() -> None:
    with pytest.raises(BadInput, match="--shard auto"):
        resolve_shard(None, 3, {})
    with pytest.raises(BadInput, match="--shard auto"):
        resolve_shard("1/2", 3, {})


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CACHECTL_SHARDS": "3"}, "JOB_COMPLETION_INDEX is not set"),
        ({"JOB_COMPLETION_INDEX": "1"}, "no shard count"),
    ],
)
def test_cli_shard_auto_missing_env_exits_2_writing_nothing(
    tmp_path: Path, monkeypatch, env: dict[str, str], message: str
) -> None:
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    manifest = tiny(tmp_path)
    result = CliRunner().invoke(cli, ["warm", str(manifest), "--shard", "auto"])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert "Traceback" not in result.output
    data = Path(os.environ["XDG_DATA_HOME"]) / "cachectl"
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "cachectl"
    assert not data.exists() and not cache.exists()


def test_cli_shard_auto_dry_run_takes_the_index(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    manifest = tiny(tmp_path)
    result = CliRunner().invoke(
        cli, ["warm", str(manifest), "--shard", "auto", "--shards", "2", "--dry-run", "--json"]
    )
    assert result.exit_code == 0, result.output
    buckets = json.loads(result.stdout)["buckets"]
    # Round robin over 5 buckets: shard 2/2 is the 2nd and 4th.
    assert [(b["function"], b["bucket"]) for b in buckets] == [
        ("affine", {"batch": 1, "mode": "tanh"}),
        ("affine", {"batch": 2, "mode": "tanh"}),
    ]


# --------------------------------------------------------------------------- examples/k8s


def test_k8s_example_validates_against_the_kubernetes_schema() -> None:
    import kubernetes_validate

    docs = list(yaml.safe_load_all(K8S.read_text()))
    assert [d["kind"] for d in docs] == ["Job", "Deployment"]
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema error

    job, deployment = docs
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    (container,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["CACHECTL_SHARDS"]["value"] == str(spec["completions"])
    assert container["command"][:3] == ["cachectl", "warm", "examples/manifest.yaml"]
    assert container["command"][3:5] == ["--shard", "auto"]
    assert "CACHECTL_DB" in env and (REPO / container["command"][2]).is_file()
    (serve,) = deployment["spec"]["template"]["spec"]["containers"]
    assert serve["command"][:3] == ["cachectl", "exec", "--readonly"]


def test_k8s_bundle_pull_recipe_validates_against_the_kubernetes_schema() -> None:
    """examples/k8s/pull-bundle.yaml (tests/test_oci.py runs its init container's command)."""
    import kubernetes_validate

    (deployment,) = yaml.safe_load_all((REPO / "examples/k8s/pull-bundle.yaml").read_text())
    kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert (
        "cachectl bundle pull oci://" in init["args"][0] and "--for-this-machine" in init["args"][0]
    )
    (serve,) = pod["containers"]
    assert serve["command"][:3] == ["cachectl", "exec", "--readonly"]
    assert {m["name"]: m.get("readOnly") for m in serve["volumeMounts"]}["cache"] is True


def test_k8s_deviceless_tpu_job_validates_and_names_a_known_topology() -> None:
    import kubernetes_validate

    from cachectl.core.topologies import parse_topology

    path = K8S.parent / "warm-tpu-deviceless-job.yaml"
    (job,) = list(yaml.safe_load_all(path.read_text()))
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    command = container["command"]
    assert command[:3] == ["cachectl", "warm", "examples/manifest.yaml"]
    topology = command[command.index("--topology") + 1]
    assert parse_topology(topology).chips == 4  # a known, single-host slice
    assert "google.com/tpu" not in str(container.get("resources"))  # a CPU node: no TPU held
    assert (REPO / command[2]).is_file()


def test_k8s_schema_check_catches_a_mistake() -> None:
    import kubernetes_validate

    job = next(yaml.safe_load_all(K8S.read_text()))
    job["spec"]["completions"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)


# --------------------------------------------------------------------------- N processes


def _cachectl(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cachectl", *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_indexed_job_three_processes_into_s3_and_postgres_then_warm_check_100(
    tmp_path: Path, s3_bucket: str, pg_url: str
) -> None:
    """Three pods of an Indexed Job, as processes: each warms its shard; one warm-check sees 100%."""
    manifest = tiny(tmp_path, TINY_MANIFEST)
    base = dict(os.environ, CACHECTL_DB=pg_url, CACHECTL_SHARDS="3")
    for args in (["db", "upgrade"], ["cache", "add", "fleet", f"{s3_bucket}/jax"]):
        done = subprocess.run(
            [sys.executable, "-m", "cachectl", *args],
            env=base,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr

    pods = [
        _cachectl(
            ["warm", str(manifest), "--shard", "auto", "--cache", "fleet", "--json", "--jobs", "1"],
            dict(base, JOB_COMPLETION_INDEX=str(i)),
        )
        for i in range(3)
    ]
    reports = []
    try:
        for pod in pods:
            try:
                out, err = pod.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                for other in pods:
                    other.kill()
                pytest.fail(
                    "a pod ran past 300 s and was killed\n"
                    + "\n".join(
                        f"--- pod {i} stderr:\n{p.communicate()[1][-3000:]}"
                        for i, p in enumerate(pods)
                    )
                )
            assert pod.returncode == 0, err
            reports.append(json.loads(out))
    finally:  # a failed pod leaves none of the others running past this test
        for pod in pods:
            if pod.poll() is None:
                pod.kill()
            pod.communicate()
    assert [r["summary"]["buckets"] for r in reports] == [2, 2, 1]
    # The tiny functions run nothing eagerly: no pod claims another's buckets as its own.
    assert [r["side_programs"] for r in reports] == [[], [], []]
    assert sum(r["summary"]["compiled"] for r in reports) == 5
    keys = [b["key"] for r in reports for b in r["buckets"]]
    assert len(set(keys)) == 5
    assert len({r["namespace"] for r in reports}) == 1
    assert reports[0]["namespace"].startswith(f"{s3_bucket}/jax/")

    from cachectl.index import open_index

    index = open_index(pg_url)
    try:
        (env,) = index.environment_stats("fleet")
        entries = index.list_entries(env.id)
        assert {e.key for e in entries} == set(keys) and {e.origin for e in entries} == {"warm"}
        assert all(e.aot_sha256 for e in entries)
    finally:
        index.close()

    check = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachectl",
            "warm-check",
            str(manifest),
            "--cache",
            "fleet",
            "--json",
        ],
        env=base,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr
    summary = json.loads(check.stdout)["summary"]
    assert summary["coverage"] == 100.0 and summary["hits"] == 5 and summary["buckets"] == 5
