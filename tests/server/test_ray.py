"""verispec on Ray Serve end to end: a real two-node Ray cluster on this machine, `verispec serve
--ray` deploying onto it from a process of its own, Ray's HTTP proxy, the official openai client.

The cluster (ray.cluster_utils.Cluster) has a head node with no CPUs, which holds Serve's
controller and a proxy, and a worker node with 2, where the replicas run: every request
crosses from one node to another, as on a real cluster started with `ray start --head` and
`ray start --address`. The command deploys the demo pair as 2 to 3 replicas of half a CPU
each, autoscaled with short delays; its texts are compared with a single `verispec serve` (the
same settings, a real uvicorn in this process). Ray's start-up is paid once, by the module's
fixtures; the configuration checks before them need no cluster.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray
import yaml
from ray import serve
from ray.cluster_utils import Cluster

from verispec import cli
from verispec.errors import ConfigError
from verispec.server import ServerSettings, create_app
from verispec.server.ray import RaySettings, app_builder, deploy
from verispec.server.ray.deployment import REPLICA_HEADER
from verispec.server.ray.run import DeploymentFailed
from verispec.server.ray.settings import RAY_LOOK_BACK_PERIOD
from verispec.server.run import load_decoder
from verispec.text.demo import heldout_prompts

from live_server import RAY_PROXY_PATIENCE, ServerThread, serving_command, wait_for

pytestmark = pytest.mark.usefixtures("all_cores")  # Ray's CPUs, unpinned

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "ray-key"
MODEL = "demo"
APP, DEPLOYMENT = "verispec", "VerispecServer"
# the settings both servers run: the Ray replicas and the single server they are compared with
SERVER_FLAGS = ["--api-key", API_KEY, "--model-name", MODEL, "--threads", "1",
                "--max-tokens-limit", "600", "--max-prompt-tokens", "256",
                "--max-body-bytes", "65536"]
# 2-3 replicas of half a CPU: 3 fit the worker node's 2 CPUs beside a replica that fails to
# load (test_a_model_that_does_not_load_fails_the_deployment). Short delays and window, so
# that the autoscaler acts within the test.
RAY_FLAGS = ["--min-replicas", "2", "--max-replicas", "3", "--target-ongoing-requests", "2",
             "--upscale-delay", "0", "--downscale-delay", "1", "--autoscaling-window", "10.5",
             "--replica-cpus", "0.5"]
# Ray's own tunables for a test: replicas and proxies report load every half second, not 10;
# proxies get live_server.RAY_PROXY_PATIENCE
RAY_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
           "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
           "RAY_USAGE_STATS_ENABLED": "0", **RAY_PROXY_PATIENCE}


def server_settings(port: int = 8000) -> ServerSettings:
    args = cli.build_parser().parse_args(["serve", *SERVER_FLAGS, "--port", str(port)])
    return ServerSettings.from_args(args)


# --- bad configuration: no cluster needed ---------------------------------------------------


@pytest.mark.parametrize("flags, field", [
    (["--replicas", "0"], "replicas=0"),
    (["--replicas", "2", "--max-replicas", "3"], "replicas=2"),
    (["--min-replicas", "3", "--max-replicas", "2"], "max_replicas=2"),
    (["--min-replicas", "2"], "max_replicas=None"),
    (["--min-replicas", "-1", "--max-replicas", "2"], "min_replicas=-1"),
    (["--replicas", "2", "--target-ongoing-requests", "4"], "target_ongoing_requests=4.0"),
    (["--max-replicas", "2", "--target-ongoing-requests", "0"], "target_ongoing_requests=0.0"),
    (["--max-replicas", "2", "--downscale-delay", "-1"], "downscale_delay=-1.0"),
    (["--max-replicas", "2", "--autoscaling-window", "5"], "autoscaling_window=5.0"),
    (["--replica-cpus", "0"], "replica_cpus=0.0"),
    (["--port", "0"], "port=0"),
    (["--device", "cuda", "--replica-gpus", "0"], "replica_gpus=0.0"),
    (["--route-prefix", "v1"], "route_prefix='v1'"),
])
def test_bad_configuration_is_one_line_naming_the_field(capsys, flags, field):
    assert cli.main(["serve", "--ray", *flags]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"verispec: error: {field} is invalid: ")


def test_ray_flags_without_ray_are_refused(capsys):
    assert cli.main(["serve", "--replicas", "2"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == ("verispec: error: --replicas applies to a Ray "
                                       "deployment; add --ray, or drop it.\n")


def test_without_ray_installed_the_error_names_the_extra():
    """verispec imports without Ray (None in sys.modules makes `import ray` fail), and
    --ray says what to install, in one line, before binding or loading anything."""
    code = ("import sys; sys.modules['ray'] = None; import verispec, verispec.server.ray; "
            "from verispec.cli import main; sys.exit(main(['serve', '--ray']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == cli.EXIT_USAGE, done.stderr
    assert done.stderr == ("verispec: error: verispec serve --ray needs the ray extra (ray is "
                           "not installed): pip install 'verispec[ray]'.\n")


def test_deployment_options_say_what_the_settings_say():
    server = server_settings()
    fixed = RaySettings(replicas=2, replica_cpus=0.5).deployment_options(server)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert fixed["max_ongoing_requests"] == server.max_batch_size + server.max_queue
    assert fixed["max_constructor_retry_count"] == 2
    scaled = RaySettings(max_replicas=4).deployment_options(server)["autoscaling_config"]
    assert scaled["min_replicas"] == 1 and scaled["max_replicas"] == 4
    assert scaled["target_ongoing_requests"] == server.max_batch_size
    assert scaled["look_back_period_s"] == RAY_LOOK_BACK_PERIOD
    cuda = ServerSettings(device="cuda")
    assert RaySettings().deployment_options(cuda)["ray_actor_options"]["num_gpus"] == 1.0
    assert RaySettings(replica_cpus=3).replica_threads(server) == 1  # --threads 1 wins
    assert RaySettings(replica_cpus=3).replica_threads(ServerSettings()) == 3


def test_the_example_config_is_a_serve_run_config():
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / "examples" / "ray-serve.yaml").read_text())
    ServeDeploySchema.model_validate(config)  # what `serve run` checks first
    (application,) = config["applications"]
    module, _, name = application["import_path"].partition(":")
    builder = getattr(__import__(module, fromlist=[name]), name)
    assert builder is app_builder
    assert isinstance(builder(application["args"]), serve.Application)
    with pytest.raises(ConfigError, match="route_prefix='/x' is invalid in a serve run"):
        builder({**application["args"], "route_prefix": "/x"})
    with pytest.raises(ConfigError, match="replica='2' is invalid: expected a ServerSettings"):
        builder({"replica": "2"})


# --- a two-node cluster, the command deploying onto it ---------------------------------------


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as env:
        for name, value in RAY_ENV.items():
            env.setenv(name, value)
        nodes = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False, "object_store_memory": 80 << 20})
        nodes.add_node(num_cpus=2, object_store_memory=80 << 20)
        try:
            ray.init(address=nodes.address, logging_level="WARNING")
            yield nodes
        finally:
            ray.shutdown()
            nodes.shutdown()


@pytest.fixture(scope="module")
def port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def command(cluster, port, tmp_path_factory):
    """`verispec serve --ray` against the cluster, in a process of its own: (process, url, the
    file its output goes to). Ended by the last test; here only if a test failed before."""
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    with serving_command(["serve", *SERVER_FLAGS, "--port", str(port), "--ray", "--ray-address",
                          cluster.address, *RAY_FLAGS], log) as process:
        yield process, f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module")
def single():
    """One `verispec serve` with the same settings: the texts and bodies to match."""
    settings = server_settings()
    with ServerThread(create_app(load_decoder(settings), settings)) as running:
        yield running


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def replica_states() -> dict[str, int]:
    return dict(serve.status().applications[APP].deployments[DEPLOYMENT].replica_states)


def replica_names() -> set[str]:
    return {actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["name"].startswith(f"SERVE_REPLICA::{APP}#")}


def generate(client: openai.OpenAI, chat: bool, stream: bool, prompt: str, **kwargs):
    """(text, finish_reason) of one completion or chat completion, streamed or not."""
    if chat:
        create, extra = client.chat.completions.create, {"messages": [
            {"role": "user", "content": prompt}]}
    else:
        create, extra = client.completions.create, {"prompt": prompt}
    out = create(model=MODEL, stream=stream, **extra, **kwargs)
    if not stream:
        choice = out.choices[0]
        return (choice.message.content if chat else choice.text), choice.finish_reason
    text, finish_reason = "", None
    for chunk in out:
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish_reason = choice.finish_reason or finish_reason
    return text, finish_reason


def test_the_command_deploys_on_an_existing_multi_node_cluster(command, port):
    _, url, log = command
    assert (f"verispec: serving 'demo' on http://127.0.0.1:{port} through Ray Serve (2-3 "
            "replicas, autoscaled; 0.5 CPU each; on the Ray cluster; API key required; OpenAI "
            "routes under /v1)") in log.read_text()
    assert len([node for node in ray.nodes() if node["Alive"]]) == 2
    # the head has no CPUs: the replicas (half a CPU each) run on the other node
    assert replica_states() == {"RUNNING": 2} and len(replica_names()) == 2
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL and health["speculative"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_greedy_text_equals_the_single_server(command, single, chat, stream):
    """Each prompt twice through the proxy, which picks between the two replicas each time."""
    for prompt in heldout_prompts()[:2]:
        expected = generate(openai_client(single.url), chat, stream, prompt, max_tokens=32,
                            temperature=0)
        for _ in range(2):
            assert generate(openai_client(command[1]), chat, stream, prompt, max_tokens=32,
                            temperature=0) == expected


@pytest.mark.parametrize("chat, stream", [(False, False), (True, True)],
                         ids=["completions-json", "chat-stream"])
def test_seeded_sampled_text_equals_the_single_server(command, single, chat, stream):
    kwargs = {"max_tokens": 32, "temperature": 0.9, "top_p": 0.95, "seed": 7}
    prompt = heldout_prompts()[2]
    expected = generate(openai_client(single.url), chat, stream, prompt, **kwargs)
    assert generate(openai_client(command[1]), chat, stream, prompt, **kwargs) == expected


BAD_REQUESTS = {  # name: (path, headers beyond the key and JSON, body)
    "no key": ("/v1/completions", {"Authorization": ""}, {"prompt": "x"}),
    "unknown model": ("/v1/completions", {}, {"model": "gpt-4", "prompt": "x"}),
    "bad value": ("/v1/completions", {}, {"prompt": "x", "temperature": -1}),
    "wrong type": ("/v1/completions", {}, {"prompt": "x", "max_tokens": "5"}),
    "too many tokens": ("/v1/completions", {}, {"prompt": "x", "max_tokens": 601}),
    "long prompt": ("/v1/completions", {}, {"prompt": "def f(x):\n" * 200}),
    "large body": ("/v1/completions", {}, {"prompt": "x" * 70_000}),
    "not JSON": ("/v1/completions", {"Content-Type": "text/plain"}, {"prompt": "x"}),
    "foreign host": ("/v1/completions", {"Host": "evil.example"}, {"prompt": "x"}),
    "unknown route": ("/v1/embeddings", {}, {"input": "x"}),
    "chat without messages": ("/v1/chat/completions", {}, {"messages": []}),
}


def test_bad_requests_get_the_single_servers_statuses_and_bodies(command, single):
    def answers(url: str) -> dict[str, tuple[int, object, str | None]]:
        found = {}
        with httpx.Client(base_url=url, timeout=60) as http:
            for name, (path, headers, body) in BAD_REQUESTS.items():
                response = http.post(path, json=body, headers={
                    "Authorization": f"Bearer {API_KEY}", **headers})
                found[name] = (response.status_code, response.json(),
                               response.headers.get("WWW-Authenticate"))
        return found

    expected = answers(single.url)
    assert {name: status for name, (status, _, _) in expected.items()} == {
        "no key": 401, "unknown model": 404, "bad value": 400, "wrong type": 422,
        "too many tokens": 400, "long prompt": 413, "large body": 413, "not JSON": 415,
        "foreign host": 403, "unknown route": 404, "chat without messages": 400}
    assert answers(command[1]) == expected


def test_metrics_come_from_the_replicas(command):
    text = httpx.get(command[1] + "/metrics").text
    assert "verispec_rounds_total" in text and "verispec_running_requests" in text


def test_a_replica_killed_mid_stream(command):
    """Four streams over the two replicas, the replica serving the first one killed once every
    stream has text: its streams end with a connection error (never a stream that looks
    complete), the other replica's streams finish, Ray starts a replacement and new requests
    succeed. Each answer names its replica, so the test does not rely on how Ray spreads the
    streams."""
    client, outcomes, served_by = openai_client(command[1]), {}, {}
    started = threading.Barrier(5)

    def stream(index: int) -> None:
        response = client.completions.with_raw_response.create(
            model=MODEL, prompt=heldout_prompts()[index], max_tokens=200, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        served_by[index] = response.headers[REPLICA_HEADER]
        finish_reason, waited = None, False
        try:
            for chunk in response.parse():
                if not waited:
                    started.wait(60)
                    waited = True
                finish_reason = (chunk.choices[0].finish_reason if chunk.choices else None
                                 ) or finish_reason
            outcomes[index] = finish_reason
        except (openai.APIError, httpx.TransportError) as exc:
            outcomes[index] = type(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    started.wait(120)
    before = replica_names()
    assert set(served_by.values()) <= {name.rsplit("#", 1)[1] for name in before}
    killed = next(name for name in before if name.endswith("#" + served_by[0]))
    ray.kill(ray.get_actor(killed, namespace="serve"))
    for thread in threads:
        thread.join(180)
    assert sorted(outcomes) == [0, 1, 2, 3]
    for index, outcome in outcomes.items():
        if served_by[index] == served_by[0]:
            assert outcome in {openai.APIConnectionError, httpx.RemoteProtocolError}, outcomes
        else:
            assert outcome == "length", outcomes
    wait_for(lambda: len(replica_names() - before) == 1 and killed not in replica_names()
             and replica_states() == {"RUNNING": 2}, timeout=120)
    for prompt in heldout_prompts()[:4]:
        assert generate(client, False, False, prompt, max_tokens=8, temperature=0)[1]


def test_a_model_that_does_not_load_fails_the_deployment(command, port, tmp_path):
    """Deployed from this process (a second driver, another application): the replica's
    ModelLoadError comes back as DeploymentFailed, within a replica's start-up, and the
    failed application is gone; the command's application serves on."""
    missing = tmp_path / "no-model"
    started = time.monotonic()
    with pytest.raises(DeploymentFailed) as failure:
        deploy(ServerSettings(target=missing, no_draft=True, port=port, threads=1),
               RaySettings(app_name="broken", route_prefix="/broken", replica_cpus=0.5))
    assert time.monotonic() - started < 120
    message = str(failure.value)
    assert message.startswith("the Ray Serve application 'broken' failed to deploy: a replica "
                              "failed to start: verispec.errors.ModelLoadError: target path ")
    assert repr(str(missing)) in message
    assert "broken" not in serve.status().applications
    assert generate(openai_client(command[1]), False, False, "x", max_tokens=4,
                    temperature=0)[1]


def test_a_second_deployment_does_not_replace_the_first(command, port):
    wait_for(lambda: replica_states() == {"RUNNING": 2}, timeout=120)
    with pytest.raises(ConfigError, match="app_name='verispec' is invalid: an application of "
                                          "that name already runs on this cluster"):
        deploy(server_settings(port), RaySettings(replica_cpus=0.5))
    with pytest.raises(ConfigError, match="route_prefix='/' is invalid: Ray Serve refused the "
                                          "application .*Prefix / is being used by application"):
        deploy(server_settings(port), RaySettings(replica_cpus=0.5, app_name="second"))
    assert replica_states() == {"RUNNING": 2} and "second" not in serve.status().applications


def test_the_autoscaler_adds_a_replica_under_a_burst_and_removes_it_when_idle(command):
    """Eight clients sending back to back against a target of 2 requests a replica: Ray adds
    a replica up to the range's top (3, never more), every request succeeds meanwhile, and
    once the clients stop the deployment returns to 2. The clients keep on until the third
    replica runs: stopped while it starts, the load would fall below the target, and Ray may
    stop it before it ever serves."""
    client, stop, failures, counts = openai_client(command[1]), threading.Event(), [], []

    def send(index: int) -> None:
        while not stop.is_set():
            try:
                generate(client, False, False, heldout_prompts()[index], max_tokens=64,
                         temperature=0)
            except openai.APIError as exc:  # pragma: no cover - what the assert reports
                failures.append(exc)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: counts.append(replica_states()) or counts[-1] == {"RUNNING": 3},
                 timeout=120)
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert not failures
    assert all(sum(states.values()) <= 3 for states in counts)
    wait_for(lambda: replica_states() == {"RUNNING": 2}, timeout=120)
    assert generate(client, False, False, "x", max_tokens=4, temperature=0)[1]


def test_sigterm_deletes_the_application_and_exits_143(command):
    process, _, log = command
    process.send_signal(signal.SIGTERM)
    assert process.wait(120) == 128 + signal.SIGTERM
    assert APP not in serve.status().applications
    # the command's own output (Ray's forwarded replica logs are prefixed by their process)
    assert not [line for line in log.read_text().splitlines() if line.startswith("Traceback")]
