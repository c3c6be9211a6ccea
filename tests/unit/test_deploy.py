"""deploy/: the manifests parse, and they, the Dockerfile, the Slurm script and the README agree on
the image, the command, the config keys and the pinned versions; the job configs load with the
project's loader and run on Ray."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from recsys.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SAMPLE = DEPLOY / "cluster.toml"
RAYJOB = DEPLOY / "kuberay" / "rayjob.yaml"
SBATCH = DEPLOY / "slurm" / "recsys.sbatch"
DOCKERFILE = DEPLOY / "Dockerfile"
README = (ROOT / "README.md").read_text() + "\n" + (ROOT / "docs" / "cluster.md").read_text()   # the guide and its cluster page
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def manifests() -> list[dict[str, Any]]:
    import yaml  # PyYAML comes with ray, which the [test] extra installs

    return [d for d in yaml.safe_load_all(RAYJOB.read_text()) if d]


def by_kind(kind: str) -> dict[str, Any]:
    docs = [d for d in manifests() if d["kind"] == kind]
    assert len(docs) == 1, f"{RAYJOB}: {len(docs)} {kind} documents"
    return docs[0]


def groups() -> dict[str, dict[str, Any]]:
    spec = by_kind("RayJob")["spec"]["rayClusterSpec"]
    return {"head": spec["headGroupSpec"], **{g["groupName"]: g for g in spec["workerGroupSpecs"]}}


def container(group: dict[str, Any]) -> dict[str, Any]:
    (c,) = group["template"]["spec"]["containers"]
    return c


def readme_section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else None]


def configmap_config() -> str:
    return by_kind("ConfigMap")["data"]["job.toml"]


# ---------------------------------------------------------------------------------------------
# configs


def test_configmap_holds_the_sample_config() -> None:
    assert configmap_config() == SAMPLE.read_text()


@pytest.mark.parametrize("which", ["deploy/cluster.toml", "the ConfigMap"])
def test_job_configs_load(which: str, tmp_path: Path) -> None:
    path = SAMPLE
    if which == "the ConfigMap":
        path = tmp_path / "job.toml"
        path.write_text(configmap_config())
    cfg = load_config(path)
    assert cfg.ps.num_shards == 4 and cfg.train.num_trainers == 4 and len(cfg.ps.tables) == 28
    for p in (*cfg.data.train_paths, *cfg.data.eval_paths, cfg.train.run_dir):   # remote jobs: absolute paths
        assert p.startswith("/shared/"), p


def test_cluster_section_names_ray_and_the_custom_resources() -> None:
    cluster = tomllib.loads(SAMPLE.read_text())["cluster"]
    assert cluster["engine"] == "ray" and cluster["address"] == "auto" and cluster["use_gpu"] is True
    assert cluster["ps_resources"]["ps"] == 1 and cluster["trainer_resources"]["trainer"] == 1
    cfg = load_config(SAMPLE)
    assert (cfg.cluster.engine, cfg.cluster.address, cfg.cluster.use_gpu) == ("ray", "auto", True)
    assert cfg.train.device == "cuda"


# ---------------------------------------------------------------------------------------------
# KubeRay


def test_rayjob_runs_recsys_train_on_the_mounted_config() -> None:
    spec = by_kind("RayJob")["spec"]
    assert by_kind("RayJob")["apiVersion"] == "ray.io/v1"
    assert spec["entrypoint"] == "recsys train --config /etc/recsys/job.toml"
    assert spec["rayClusterSpec"]["rayVersion"] == docker_args()["RAY_VERSION"]
    config_map = by_kind("ConfigMap")["metadata"]["name"]
    for name, group in groups().items():
        pod = group["template"]["spec"]
        volume = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container(group)["volumeMounts"]}
        assert volume[mounts["/etc/recsys"]]["configMap"]["name"] == config_map, name
        assert "/shared" in mounts, name            # the config's data and run directory


def test_rayjob_groups_offer_the_configs_custom_resources() -> None:
    g = groups()
    assert set(g) == {"head", "ps", "trainer"}
    cfg = load_config(SAMPLE)
    cluster = tomllib.loads(SAMPLE.read_text())["cluster"]
    for name, count in (("ps", cfg.ps.num_shards), ("trainer", cfg.train.num_trainers)):
        started = g[name]["rayStartParams"]["resources"]         # '"{\"ps\": 1}"': a JSON string, quoted
        assert re.fullmatch(rf'"{{\\"{name}\\": 1}}"', started), started
        assert g[name]["replicas"] == count                     # one shard / one trainer per pod
        limits = container(g[name])["resources"]["limits"]
        assert float(limits["cpu"]) >= cluster[f"{name}_resources"]["CPU"]
    assert container(g["trainer"])["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in container(g["ps"])["resources"]["limits"]
    assert g["head"]["rayStartParams"]["num-cpus"] == "0"


def test_rayjob_images_are_the_dockerfile_tags_in_the_readme() -> None:
    version = PYPROJECT["project"]["version"]
    images = {name: container(group)["image"] for name, group in groups().items()}
    assert images == {"head": f"registry.example.com/recsys-hybrid:{version}-cpu",
                      "ps": f"registry.example.com/recsys-hybrid:{version}-cpu",
                      "trainer": f"registry.example.com/recsys-hybrid:{version}-cu130"}
    k8s = readme_section("Kubernetes (KubeRay)")
    for image in set(images.values()):
        assert f"docker push {image}" in k8s
        local = image.split("/", 1)[1]
        assert f"-t {local} ." in readme_section("Run on a Ray cluster: VMs")     # built under that tag
    docker = DOCKERFILE.read_text()
    assert f"-t recsys-hybrid:{version}-cpu ." in docker and f"-t recsys-hybrid:{version}-cu130 ." in docker


def test_readme_names_the_manifests_commands_and_config_keys() -> None:
    vms, k8s, slurm = (readme_section(t) for t in ("Run on a Ray cluster: VMs", "Kubernetes (KubeRay)", "Slurm"))
    assert "kubectl apply -f deploy/kuberay/rayjob.yaml" in k8s
    assert f"`{by_kind('RayJob')['spec']['entrypoint']}`" in k8s
    assert f"kubectl get rayjob {by_kind('RayJob')['metadata']['name']}" in k8s
    assert "sbatch deploy/slurm/recsys.sbatch" in slurm
    assert "recsys ray-submit --config deploy/cluster.toml --address http://HEAD:8265" in vms
    assert "ray job submit --address http://HEAD:8265 --working-dir job -- recsys train --config job.toml" in vms
    # the README's [cluster] block is the sample config's, line for line
    block = vms.split("```toml\n", 1)[1].split("```", 1)[0]
    assert block.strip() in SAMPLE.read_text()
    for key in ("engine", "address", "ps_resources", "trainer_resources", "use_gpu", "placement"):
        assert re.search(rf"^{key} = ", block, re.M), key


# ---------------------------------------------------------------------------------------------
# Dockerfile


def docker_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.M))


def pinned(requirement_list: list[str], name: str) -> str:
    for req in requirement_list:
        m = re.fullmatch(rf"{re.escape(name)}(\[[\w,]+\])?==([\w.]+)", req)
        if m:
            return m.group(2)
    raise AssertionError(f"pyproject.toml pins no {name}: {requirement_list}")


def test_dockerfile_pins_pyprojects_versions() -> None:
    args, deps = docker_args(), PYPROJECT["project"]["dependencies"]
    assert args["TORCH_VERSION"] == pinned(deps, "torch")
    assert args["FBGEMM_GPU_VERSION"] == pinned(deps, "fbgemm-gpu-cpu")
    assert args["PYTHON_VERSION"] == PYPROJECT["project"]["requires-python"].removeprefix(">=")
    assert args["VARIANT"] == "cpu"
    docker = DOCKERFILE.read_text()
    assert '"fbgemm-gpu-cpu==${FBGEMM_GPU_VERSION}"' in docker and '"fbgemm-gpu==${FBGEMM_GPU_VERSION}"' in docker
    assert 'pip install ".[ray]"' in docker
    assert '"ray[default,train]==${RAY_VERSION}"' in docker


def test_dockerfile_ray_is_pyprojects_ray_extra() -> None:
    extras = PYPROJECT["project"].get("optional-dependencies", {})
    assert "ray" in extras, "pyproject.toml has no [ray] extra"
    assert any(r.startswith("ray[") for r in extras["test"]), "the [test] extra must install ray (CI runs the Ray tests)"
    assert docker_args()["RAY_VERSION"] == pinned(extras["ray"], "ray")


def test_dockerfile_copies_every_package() -> None:
    packages = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\w+) \1$", DOCKERFILE.read_text(), re.M))
    assert {p.rstrip("*") for p in packages} <= copied


# ---------------------------------------------------------------------------------------------
# Slurm


def test_sbatch_is_valid_bash_and_runs_the_job_on_ray() -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash here")
    r = subprocess.run([bash, "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    text = SBATCH.read_text()
    assert "ray start --head --block" in text and "ray start --block --address=" in text
    assert 'export RAY_ADDRESS="$head_ip:$RAY_PORT"' in text             # cluster.address = "auto"
    assert '\\"ps\\": $SHARDS_PER_NODE' in text and '\\"trainer\\": $GPUS_PER_NODE' in text
    assert re.search(r'^recsys train --config "\$CONFIG"$', text, re.M)
    assert "CONFIG=${CONFIG:-deploy/cluster.toml}" in text
    assert "trap cleanup EXIT" in text                                   # Ray is stopped whatever happens


STUBS = {
    # scontrol show hostnames LIST -> one node a line
    "scontrol": 'for n in $FAKE_NODES; do echo "$n"; done\n',
    # srun [options] CMD...: log the node and the command, then run CMD (as a process of its own)
    "srun": ('node=""\nwhile [[ $1 == -* ]]; do\n  case $1 in -w) node=$2; shift 2;; *) shift;; esac\ndone\n'
             'echo "srun $node $*" >> "$FAKE_LOG"\nexec "$@"\n'),
    "hostname": 'echo "10.0.0.1 fd00::1"\n',
    # ray start --block: stays up until killed, and says it was stopped
    "ray": 'trap \'echo "ray stopped $*" >> "$FAKE_LOG"; exit 0\' TERM\necho "ray $*" >> "$FAKE_LOG"\n'
           'while true; do sleep 0.1; done\n',
    # the wait for the nodes: returns once every `ray start` is up (as the real one waits for ray.nodes())
    "python": ('cat > /dev/null\nuntil (( $(grep -c "^ray start" "$FAKE_LOG") >= $2 )); do sleep 0.1; done\n'
               'echo "python wait $* RAY_ADDRESS=$RAY_ADDRESS" >> "$FAKE_LOG"\n'),
    "recsys": 'echo "recsys $* RAY_ADDRESS=$RAY_ADDRESS" >> "$FAKE_LOG"\nexit "${FAKE_RC:-0}"\n',
}


@pytest.mark.parametrize("rc", [0, 3])
def test_sbatch_starts_ray_runs_the_job_and_stops_ray(rc: int, tmp_path: Path) -> None:
    """The script under stub srun / scontrol / ray / python / recsys: roles, address, exit code, cleanup."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(log), "FAKE_NODES": "n0 n1 n2 n3",
           "FAKE_RC": str(rc), "SLURM_JOB_NODELIST": "n[0-3]", "HEAD_START_S": "0", "PS_NODES": "2",
           "SHARDS_PER_NODE": "2", "GPUS_PER_NODE": "8", "CONFIG": "/shared/job.toml"}
    r = subprocess.run([bash, str(SBATCH)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == rc, r.stderr                       # the batch job's exit code is the job's
    lines = log.read_text().splitlines()
    heads = [x for x in lines if x.startswith("srun n0 ray start --head")]
    assert len(heads) == 1 and "--node-ip-address=10.0.0.1" in heads[0] and "--num-cpus=0" in heads[0]
    workers = {x.split()[1]: x for x in lines if x.startswith("srun n") and "ray start --block --address" in x}
    assert set(workers) == {"n1", "n2", "n3"}
    assert all("--address=10.0.0.1:6379" in w for w in workers.values())
    assert '{"ps": 2}' in workers["n1"] and '{"ps": 2}' in workers["n2"] and '{"trainer": 8}' in workers["n3"]
    assert "python wait - 4 300 RAY_ADDRESS=10.0.0.1:6379" in lines
    job = lines.index("recsys train --config /shared/job.toml RAY_ADDRESS=10.0.0.1:6379")
    assert job > lines.index("python wait - 4 300 RAY_ADDRESS=10.0.0.1:6379")    # after every node joined
    stopped = [x for x in lines[job:] if x.startswith("ray stopped start")]
    assert len(stopped) == 4                                  # the head and the 3 workers, after the job


def test_sbatch_refuses_too_few_nodes(tmp_path: Path) -> None:
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\n" + STUBS["scontrol"])
    (bin_dir / "scontrol").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_NODES": "n0 n1", "SLURM_JOB_NODELIST": "n[0-1]"}
    r = subprocess.run([bash, str(SBATCH)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2 and "need at least 3 nodes" in r.stderr
