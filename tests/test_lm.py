# mlx_moe_plan.lm against mlx-lm's own commands: small random MoE models on
# disk (tests/lm_fixtures.py), run by `python -m mlx_moe_plan.lm COMMAND` in
# subprocesses, patched and with --no-patch, must print the same greedy text
# (generate, chat, the server's chat completions through the OpenAI client),
# the benchmark must report its rates, and bad input must end in a clear
# message and a non-zero exit, never a traceback through this package.
# Nothing here reaches the network: the models are local directories, the
# Hugging Face libraries run offline, and servers listen on 127.0.0.1.

from __future__ import annotations

import contextlib
import functools
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm", reason="the commands are mlx-lm's")
pytest.importorskip("tokenizers", reason="the test models' tokenizer is built with it")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import mlx_moe_plan  # noqa: E402
from mlx_moe_plan import lm  # noqa: E402
from mlx_moe_plan.nn import FusedMoEBlock, SwitchGLU  # noqa: E402
from mlx_moe_plan.projections import RowsProjection  # noqa: E402

import lm_fixtures  # noqa: E402  (beside this file, on sys.path as pytest imports it)
import two_ranks  # noqa: E402

MOE_MODELS = ["qwen3_moe", "mixtral", "gpt_oss"]
# Generous bounds on every wait: a command here takes about a second.
COMMAND_TIMEOUT_S = 120
SERVER_START_TIMEOUT_S = 60
SERVER_STOP_TIMEOUT_S = 10
PACKAGE_DIR = str(Path(mlx_moe_plan.__file__).resolve().parent)
# Prompts of 2 and 45 words: with the chat template's 5 tokens, K * T below
# mlx-lm's 64-entry sort threshold for every model, and above it (by the first
# prefill chunk, T - 1 tokens) for K = 2 and 4.
SHORT_PROMPT = "hello world"
LONG_PROMPT = " ".join(lm_fixtures.WORDS[i % len(lm_fixtures.WORDS)] for i in range(45))


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """Model directories by name: `NAME` (float32), `NAME-4bit`, and `llama` (no MoE)."""
    root = tmp_path_factory.mktemp("lm_models")
    paths = {}
    for name in lm_fixtures.CONFIGS:
        paths[name] = lm_fixtures.write_model(root / name, name)
        if name in MOE_MODELS:
            paths[f"{name}-4bit"] = lm_fixtures.write_model(root / f"{name}-4bit", name, bits=4)
    return paths


def offline_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               NO_COLOR="1", TERM="dumb", PYTHONUNBUFFERED="1")
    return env


def ours(*args: str) -> list[str]:
    return [sys.executable, "-m", "mlx_moe_plan.lm", *map(str, args)]


def run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True,
                          env=offline_env(), timeout=COMMAND_TIMEOUT_S)


def run_patched_and_not(args: list[str], stdin: str | None = None):
    """`ours(*args)` and `ours("--no-patch", *args)`, side by side (two cores)."""
    with ThreadPoolExecutor(2) as pool:
        patched = pool.submit(run, ours(*args), stdin)
        unpatched = pool.submit(run, ours("--no-patch", *args), stdin)
        return patched.result(), unpatched.result()


def succeeded(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    return result


def patched_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("mlx-moe-plan:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def generated_text(stdout: str) -> str:
    """The text `mlx_lm generate` prints between its two `==========` lines."""
    parts = stdout.split("==========\n")
    assert len(parts) >= 3, stdout
    return parts[1]


def prompt_tokens(stdout: str) -> int:
    return int(re.search(r"^Prompt: (\d+) tokens", stdout, re.M).group(1))


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short", "long"])
@pytest.mark.parametrize("variant", ["", "-4bit"], ids=["float32", "4bit"])
@pytest.mark.parametrize("name", MOE_MODELS)
def test_generate_matches_unpatched(models, name, variant, prompt):
    args = ["generate", "--model", models[name + variant], "--prompt", prompt,
            "--max-tokens", "12", "--temp", "0"]
    patched, unpatched = map(succeeded, run_patched_and_not(args))
    message = patched_line(patched)
    architecture = lm_fixtures.CONFIGS[name]["architectures"][0]
    assert message.startswith(f"mlx-moe-plan: patched 2 MoE layers of {architecture} "
                              f"(2 blocks fused"), message
    assert "unpatched" in patched_line(unpatched)

    # The routed entries of the first forward, against mlx-lm's sort threshold.
    tokens, top_k = prompt_tokens(patched.stdout), lm_fixtures.TOP_K[name]
    if prompt == SHORT_PROMPT:
        assert tokens * top_k < 64
    else:
        assert (tokens - 1) * top_k > 64
    text = generated_text(patched.stdout)
    assert len(set(text.split())) >= 3, f"too uniform a text to compare: {text!r}"
    assert text == generated_text(unpatched.stdout)


def test_generate_with_adapters_matches_unpatched(models, tmp_path):
    # LoRA adapters wrap the experts' projections after the patch (mlx-lm's
    # load applies them to the model load_model returns): the patched layer
    # runs them as it runs the plain projections.
    adapter = lm_fixtures.write_adapter(tmp_path / "adapter", models["mixtral"])
    args = ["generate", "--model", models["mixtral"], "--adapter-path", adapter,
            "--prompt", LONG_PROMPT, "--max-tokens", "12", "--temp", "0"]
    patched, unpatched = map(succeeded, run_patched_and_not(args))
    assert "patched 2 MoE layers of MixtralForCausalLM" in patched_line(patched)
    plain = succeeded(run(ours("--no-patch", *args[:3], *args[5:])))
    text = generated_text(patched.stdout)
    assert text == generated_text(unpatched.stdout)
    assert text != generated_text(plain.stdout), "the adapters changed nothing"


def test_cache_prompt_then_generate_matches_unpatched(models, tmp_path):
    # cache_prompt saves a prompt's KV cache (the prompt's forward runs the
    # patched layers, over mlx-lm's sort threshold), generate continues from
    # it: the same text as mlx-lm's, whichever side saved the cache.
    model = models["qwen3_moe"]
    saved = {"patched": tmp_path / "patched.safetensors",
             "unpatched": tmp_path / "unpatched.safetensors"}
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run, ours(*([] if side == "patched" else ["--no-patch"]),
                                      "cache_prompt", "--model", model, "--prompt",
                                      LONG_PROMPT, "--prompt-cache-file", path))
                for side, path in saved.items()]
        for job in jobs:
            succeeded(job.result())
    assert all(path.stat().st_size > 0 for path in saved.values())
    texts = {}
    for side, path in saved.items():
        args = ["generate", "--model", model, "--prompt-cache-file", path, "--prompt",
                SHORT_PROMPT, "--max-tokens", "12", "--temp", "0"]
        patched, unpatched = map(succeeded, run_patched_and_not(args))
        texts[side] = generated_text(patched.stdout)
        assert texts[side] == generated_text(unpatched.stdout), side
    assert texts["patched"] == texts["unpatched"]
    assert len(set(texts["patched"].split())) >= 3, texts


def transcript(stdout: str) -> list[str]:
    """A chat's output, all but the rates."""
    return [line for line in stdout.splitlines() if "tok/s" not in line]


def test_chat_matches_unpatched(models):
    args = ["chat", "--model", models["mixtral"], "--max-tokens", "12", "--temp", "0"]
    patched, unpatched = map(succeeded, run_patched_and_not(args, stdin="hello the model\nq\n"))
    assert "patched 2 MoE layers of MixtralForCausalLM" in patched_line(patched)

    assert "bye" in patched.stdout
    assert transcript(patched.stdout) == transcript(unpatched.stdout)


@contextlib.contextmanager
def running_server(argv: list[str], log_dir: Path, label: str):
    """`argv` + `--host 127.0.0.1 --port PORT` running; yields PORT; stops it on exit."""
    port = two_ranks.free_port()
    stdout, stderr = log_dir / f"{label}.out", log_dir / f"{label}.err"
    with open(stdout, "w") as out, open(stderr, "w") as err:
        server = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=out, stderr=err, env=offline_env())
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"{label} server exited ({server.returncode}):\n"
                            f"{stderr.read_text()[-3000:]}")
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            if time.monotonic() > deadline:
                pytest.fail(f"{label} server not listening after {SERVER_START_TIMEOUT_S} s")
            time.sleep(0.1)
        yield port, stderr
    finally:
        server.terminate()
        try:
            server.wait(timeout=SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=SERVER_STOP_TIMEOUT_S)


def chat_completions(port: int) -> tuple[str, str]:
    """One chat completion, then the same streamed, through the OpenAI client."""
    import openai

    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                       max_retries=0, timeout=COMMAND_TIMEOUT_S) as client:
        request = dict(model="default_model", temperature=0, max_tokens=10,
                       messages=[{"role": "user", "content": "hello the model"}])
        whole = client.chat.completions.create(**request).choices[0].message.content
        stream = client.chat.completions.create(**request, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or ""
                           for chunk in stream if chunk.choices)
    return whole, streamed


@pytest.mark.parametrize("model", ["qwen3_moe", "mixtral-4bit"])
def test_server_chat_completions_match_unpatched(models, model, tmp_path, monkeypatch):
    # No proxy of the environment between the client and loopback.
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
        monkeypatch.delenv(proxy.lower(), raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    args = ["server", "--model", models[model]]
    with running_server(ours(*args), tmp_path, "patched") as (port, patched_log), \
            running_server(ours("--no-patch", *args), tmp_path, "unpatched") as (port_ref, _):
        with ThreadPoolExecutor(2) as pool:
            patched = pool.submit(chat_completions, port)
            unpatched = pool.submit(chat_completions, port_ref)
            (whole, streamed), (whole_ref, streamed_ref) = patched.result(), unpatched.result()
        assert "mlx-moe-plan: patched 2 MoE layers of" in patched_log.read_text()
    assert whole, "the server generated no text"
    assert (whole, streamed) == (whole_ref, streamed_ref)
    assert streamed == whole


def completions_at_once(port: int, prompts: list[str]) -> list[str]:
    """One chat completion for each prompt, all requested at once."""
    import openai

    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                       max_retries=0, timeout=COMMAND_TIMEOUT_S) as client:
        def complete(prompt):
            return client.chat.completions.create(
                model="default_model", temperature=0, max_tokens=10,
                messages=[{"role": "user", "content": prompt}]).choices[0].message.content

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(complete, prompts))


def test_server_batch_of_requests_matches_unpatched(models, tmp_path, monkeypatch):
    # Several requests at once: the server decodes them as one batch, the
    # shape the dense projections' rows call is for.
    for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
        monkeypatch.delenv(proxy.lower(), raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    prompts = ["hello the model", "route the tokens to experts", "a fast plan", "sum the rows"]
    args = ["server", "--model", models["qwen3_moe-4bit"]]
    with running_server(ours(*args), tmp_path, "patched") as (port, _), \
            running_server(ours("--no-patch", *args), tmp_path, "unpatched") as (port_ref, _):
        got = completions_at_once(port, prompts)
        want = completions_at_once(port_ref, prompts)
    assert all(want), "the server generated no text"
    assert got == want


def console_script() -> str:
    script = Path(sys.executable).parent / "mlx-moe-lm"
    if not script.exists():
        pytest.skip("the mlx-moe-lm console script is not installed (pip install -e . does)")
    return str(script)


RATES = re.compile(r"^Averages: prompt_tps=([\d.]+), generation_tps=([\d.]+)", re.M)


def test_benchmark_reports_rates(models):
    args = ["benchmark", "--model", models["qwen3_moe-4bit"], "-p", "16", "-g", "8", "-n", "1"]
    with ThreadPoolExecutor(2) as pool:
        patched = pool.submit(run, [console_script(), *args])
        unpatched = pool.submit(run, ours("--no-patch", *args))
        patched, unpatched = succeeded(patched.result()), succeeded(unpatched.result())
    assert "patched 2 MoE layers of Qwen3MoeForCausalLM" in patched_line(patched)
    for result in (patched, unpatched):
        prompt_tps, generation_tps = map(float, RATES.search(result.stdout).groups())
        assert prompt_tps > 0 and generation_tps > 0, result.stdout


def frames(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.lstrip().startswith('File "')]


def test_missing_model_path_is_one_line(tmp_path, capsys):
    # A local path that does not exist: mlx-lm takes it for a Hugging Face
    # repo id and fails in the Hub's validation ("Repo id must be in the
    # form ..."), never naming the path; ours names it in one line, with
    # mlx-lm's exit code.
    missing = str(tmp_path / "no-such-model")
    args = ["generate", "--model", missing, "--prompt", "hello"]
    reference = run([sys.executable, "-m", "mlx_lm", *args])
    assert reference.returncode != 0 and "Repo id must be" in reference.stderr
    assert lm.main(args) == reference.returncode
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if "error" in line] == [
        f"mlx-moe-plan: error: no model at {missing}: that path does not exist (and it is "
        "not a Hugging Face repo id, namespace/name)"]


@pytest.mark.parametrize("args, missing", [
    (["--model", "/no/such/model"], "/no/such/model"),
    (["--prompt", "hi", "--draft-model=./no-such-model"], "./no-such-model"),
    (["--model", "~/no-such-model"], "~/no-such-model"),
    (["--model", "no/such/model"], "no/such/model"),  # two separators: not a repo id
    (["--model", "mlx-community/Qwen3-30B-A3B-4bit"], None),  # a repo id: the Hub's to find
    (["--model", "no-such-model"], None),
    (["--model", "models/no-such-model"], None),  # relative and absent: a repo id too
    (["--model"], None),  # no value: mlx-lm's parser says so
])
def test_missing_model_path_tells_paths_from_repo_ids(args, missing, tmp_path):
    assert lm.missing_model_path(args) == missing
    # A path that exists is mlx-lm's to load, whatever it looks like.
    assert lm.missing_model_path(["--model", str(tmp_path)]) is None


def test_missing_hub_model_is_mlx_lms_error():
    # A repo id the Hub (offline here) does not have: mlx-lm's own failure,
    # the same error and exit code as `python -m mlx_lm`, with no frame of
    # this package in its traceback.
    args = ["generate", "--model", "mlx-community/no-such-model", "--prompt", "hello"]
    with ThreadPoolExecutor(2) as pool:
        result = pool.submit(run, ours(*args))
        reference = pool.submit(run, [sys.executable, "-m", "mlx_lm", *args])
        result, reference = result.result(), reference.result()
    assert reference.returncode != 0
    assert result.returncode == reference.returncode
    assert not any(PACKAGE_DIR in line for line in frames(result.stderr)), result.stderr
    # mlx-lm's tracebacks (the exceptions it was handling first, then its
    # own) frame for frame, the last below its entry point (ours replaces it).
    *handled, last = result.stderr.split("Traceback (most recent call last):")
    *reference_handled, reference_last = reference.stderr.split(
        "Traceback (most recent call last):")
    assert list(map(frames, handled)) == list(map(frames, reference_handled))
    reference_frames = frames(reference_last)
    entry = [os.path.join("mlx_lm", "__main__.py") in line for line in reference_frames]
    assert frames(last) == reference_frames[entry.index(True) + 1:]
    error_line = reference.stderr.splitlines()[-1]
    assert error_line.startswith("huggingface_hub.errors.")
    assert error_line in result.stderr.splitlines()
    assert result.stderr.splitlines()[-1].startswith("mlx-moe-plan: mlx-lm's generate failed")


def test_model_without_moe_runs_unpatched(models):
    result = succeeded(run(ours("generate", "--model", models["llama"], "--prompt", "hello",
                                "--max-tokens", "4", "--temp", "0")))
    assert patched_line(result) == ("mlx-moe-plan: no MoE layers (mlx-lm SwitchGLU) found in "
                                    "LlamaForCausalLM: running unpatched")
    assert generated_text(result.stdout).strip()


def test_unknown_option_of_ours():
    result = run([console_script(), "--bogus", "generate", "--model", "unused"])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "mlx-moe-lm: error: unrecognized arguments: --bogus" in result.stderr


@pytest.mark.parametrize("argv, message", [
    ([], "a COMMAND is required: one of generate, chat, server, benchmark"),
    (["bogus"], "unknown command 'bogus': expected one of generate"),
    (["convert", "--hf-path", "x"], "mlx-lm's convert is not run here"),
    (["--tile-m", "-1", "generate"], "argument --tile-m: expected 0 (mlx-lm's own call)"),
    (["--tile-m", "sixteen", "generate"], "argument --tile-m: expected 0"),
    (["--no-patch", "--no-fuse", "generate"], "not with --no-patch"),
    (["--no-patch", "--no-dense-rows", "generate"], "not with --no-patch"),
    (["--no-patch", "--no-dense", "generate"], "not with --no-patch"),
    (["--no-patch", "--no-submit", "generate"], "not with --no-patch"),
    (["--expert-parallel", "--no-patch", "generate"],
     "--expert-parallel splits the experts of the patched layers: not with --no-patch"),
    (["--expert-parallel", "evaluate"], "mlx-lm's evaluate does not run with "
     "--expert-parallel (it splits its requests among the ranks"),
    (["--expert-parallel", "cache_prompt"], "mlx-lm's cache_prompt does not run with "
     "--expert-parallel (its ranks would all write the same file"),
])
def test_bad_options_of_ours(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        lm.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_commands_and_command_help_is_mlx_lms(capsys):
    with pytest.raises(SystemExit) as exit_:
        lm.main(["--help"])
    assert exit_.value.code == 0
    ours_help = capsys.readouterr().out
    assert all(name in ours_help for name in lm.COMMANDS)
    assert "--no-patch" in ours_help and "--tile-m" in ours_help
    assert "--expert-parallel" in ours_help and "mlx.launch -n 2" in ours_help
    with pytest.raises(SystemExit) as exit_:
        lm.main(["generate", "--help"])
    assert exit_.value.code == 0
    mlx_lm_help = capsys.readouterr().out
    assert mlx_lm_help.startswith("usage: python -m mlx_moe_plan.lm generate")
    assert "--max-tokens" in mlx_lm_help and "--no-patch" not in mlx_lm_help


def test_missing_hook_point_is_one_clear_error(monkeypatch, capsys):
    import mlx_lm.utils

    monkeypatch.delattr(mlx_lm.utils, "load_model")
    assert lm.main(["generate", "--model", "unused"]) == 1
    err = capsys.readouterr().err
    assert "has no mlx_lm.utils.load_model to patch models at" in err
    assert "Traceback" not in err


def test_other_mlx_lm_version_warns_and_patches(models, monkeypatch, capsys):
    import mlx_lm.utils

    load_model = mlx_lm.utils.load_model
    monkeypatch.setattr(lm, "installed_mlx_lm_version", lambda: "0.99.0")
    assert lm.main(["generate", "--model", str(models["mixtral"]), "--prompt", "hello",
                    "--max-tokens", "2", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert "warning: mlx-lm 0.99.0 is installed; these commands are tested with " \
           f"mlx-lm {lm.MLX_LM_VERSION}" in err
    assert "patched 2 MoE layers of MixtralForCausalLM" in err
    assert mlx_lm.utils.load_model is load_model  # the hook is removed afterwards


def count_ours(model) -> int:
    return sum(isinstance(module, SwitchGLU) for _, module in model.named_modules())


@pytest.mark.parametrize("loader", ["load", "sharded_load"])
def test_hook_patches_what_mlx_lm_loads(models, loader, monkeypatch):
    # Both of mlx-lm's loaders go through the hook; sharded_load calls
    # load_model twice (lazily, then for the weights): said once. Sharding
    # (a group of one process here) keeps the block's own call, and the
    # output is the unpatched model's.
    import mlx_lm.utils

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    said = []
    path = str(models["qwen3_moe"])
    with lm.patched_loads(report=said.append):
        model = getattr(mlx_lm.utils, loader)(path)[0]
    reference, _ = mlx_lm.utils.load(path)
    assert count_ours(model) == 2 and count_ours(reference) == 0
    assert said == ["patched 2 MoE layers of Qwen3MoeForCausalLM (2 blocks fused, "
                    "GEMMs by the measured rule)"]
    tokens = mx.array([list(range(3, 3 + 40))])  # 160 routed entries: sorted rows
    np.testing.assert_allclose(np.array(model(tokens)), np.array(reference(tokens)),
                               rtol=1e-5, atol=1e-5)


def test_patch_options_reach_patch_model(models):
    import mlx_lm.utils

    said = []
    with lm.patched_loads(tile_m=16, fuse=False, report=said.append):
        model, _ = mlx_lm.utils.load(str(models["gpt_oss-4bit"]))
    assert said == ["patched 2 MoE layers of GptOssForCausalLM (0 blocks fused, tile_m 16)"]
    assert {module.tile_m for _, module in model.named_modules()
            if isinstance(module, SwitchGLU)} == {16}
    assert any(isinstance(module, RowsProjection) for _, module in model.named_modules())
    with lm.patched_loads(dense_rows=False, dense=False, report=said.append):
        model, _ = mlx_lm.utils.load(str(models["gpt_oss-4bit"]))
    assert not any(isinstance(module, RowsProjection) for _, module in model.named_modules())
    with lm.patched_loads(dense_rows=False, report=said.append):
        model, _ = mlx_lm.utils.load(str(models["gpt_oss-4bit"]))
    marked = [module for _, module in model.named_modules()
              if isinstance(module, RowsProjection)]
    assert marked and all(m.dense_expert and not m.decoding_rows for m in marked)
    with lm.patched_loads(submit=False, report=said.append):
        model, _ = mlx_lm.utils.load(str(models["gpt_oss-4bit"]))
    blocks = [module for _, module in model.named_modules() if isinstance(module, FusedMoEBlock)]
    assert blocks and all(block.submit_position is None for block in blocks)


# --expert-parallel: two processes launched on the loopback (tests/two_ranks.py),
# each keeping half of every layer's experts, give one process's text. One
# launch a loader of mlx-lm's: `load` (generate) and `sharded_load` (chat,
# through our replacement), a few seconds each.
LAUNCH_TIMEOUT_S = 120


def launch_ours(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return two_ranks.launch(ours("--expert-parallel", *args), stdin=stdin,
                            timeout_s=LAUNCH_TIMEOUT_S, env=offline_env())


@two_ranks.needs_two_ranks
def test_expert_parallel_generate_matches_one_process(models):
    # generate loads with `load` on every rank: the hook loads lazily, patches
    # and shards. Only rank 0 prints its text and the report line.
    args = ["generate", "--model", models["qwen3_moe"], "--prompt", LONG_PROMPT,
            "--max-tokens", "12", "--temp", "0"]
    with ThreadPoolExecutor(2) as pool:
        launched = pool.submit(launch_ours, *args)
        reference = succeeded(pool.submit(run, ours("--no-patch", *args)).result())
        launched = succeeded(launched.result())
    assert patched_line(launched) == (
        "mlx-moe-plan: patched 2 MoE layers of Qwen3MoeForCausalLM (2 blocks fused, GEMMs "
        "by the measured rule); sharded across 2 ranks (8 of 16 experts a layer each)")
    assert launched.stdout.count("==========") == 2, launched.stdout  # one rank's text
    text = generated_text(launched.stdout)
    assert len(set(text.split())) >= 3, f"too uniform a text to compare: {text!r}"
    assert text == generated_text(reference.stdout)


@two_ranks.needs_two_ranks
def test_expert_parallel_chat_matches_one_process(models):
    # chat loads with mlx-lm's sharded_load in a group, which would cut the
    # experts by tensor parallelism: ours loads with `load` instead. Both
    # ranks read the launcher's stdin; rank 0 prints.
    args = ["chat", "--model", models["gpt_oss"], "--max-tokens", "12", "--temp", "0"]
    stdin = "hello the model\nq\n"
    with ThreadPoolExecutor(2) as pool:
        launched = pool.submit(launch_ours, *args, stdin=stdin)
        reference = succeeded(pool.submit(run, ours("--no-patch", *args), stdin).result())
        launched = succeeded(launched.result())
    assert patched_line(launched) == (
        "mlx-moe-plan: patched 2 MoE layers of GptOssForCausalLM (2 blocks fused, GEMMs "
        "by the measured rule); sharded across 2 ranks (4 of 8 experts a layer each)")

    assert "bye" in launched.stdout
    assert transcript(launched.stdout) == transcript(reference.stdout)


class StandInGroup:
    """Rank `rank` of a group of `size`, as `shard_experts` and the hook ask
    it; no collective can run on it, so only what comes before one is tested
    with it."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("rank", [0, 1])
def test_expert_parallel_load_keeps_a_ranks_experts(models, rank, monkeypatch):
    # mlx-lm's load(lazy=False) through the hook: load_model runs lazily, the
    # model is patched and keeps rank r's experts [8r, 8r + 8) of 16, bit for
    # bit the whole model's; rank 0 alone reports it.
    import mlx_lm.utils

    load_model, lazy_calls = mlx_lm.utils.load_model, []

    @functools.wraps(load_model)  # its signature, as the hook reads `lazy` by it
    def recording_load_model(*args, **kwargs):
        lazy_calls.append(kwargs.get("lazy", args[1] if len(args) > 1 else False))
        return load_model(*args, **kwargs)

    monkeypatch.setattr(mlx_lm.utils, "load_model", recording_load_model)
    said = []
    path = str(models["qwen3_moe-4bit"])
    with lm.patched_loads(expert_group=StandInGroup(2, rank), report=said.append):
        model, _ = mlx_lm.utils.load(path)
    assert lazy_calls == [True]
    assert mlx_lm.utils.load_model is recording_load_model  # restored
    whole, _ = mlx_lm.utils.load(path)
    ours_layers = [m for _, m in model.named_modules() if isinstance(m, SwitchGLU)]
    theirs = [m for p, m in whole.named_modules() if p.endswith("mlp.switch_mlp")]
    assert len(ours_layers) == len(theirs) == 2
    for layer, reference in zip(ours_layers, theirs):
        assert (layer.num_experts, layer.expert_offset) == (8, 8 * rank)
        for name in ("gate_proj", "up_proj", "down_proj"):
            for key in ("weight", "scales", "biases"):
                assert mx.array_equal(layer[name][key],
                                      reference[name][key][8 * rank:8 * rank + 8])
    assert said == ([] if rank else [
        "patched 2 MoE layers of Qwen3MoeForCausalLM (2 blocks fused, GEMMs by the "
        "measured rule); sharded across 2 ranks (8 of 16 experts a layer each)"])


def test_expert_parallel_load_never_holds_the_whole_experts(models):
    # The peak of the load is this rank's model and one whole expert array
    # (read, then cut): not the whole model (rank 1 of 2; float32 experts,
    # half of its bytes).
    import mlx_lm.utils

    path = str(models["qwen3_moe"])
    whole, _ = mlx_lm.utils.load(path)
    whole_bytes = sum(v.nbytes for _, v in tree_flatten(whole.parameters()))
    largest_expert_array = max(v.nbytes for k, v in tree_flatten(whole.parameters())
                               if ".switch_mlp." in k)
    del whole
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    with lm.patched_loads(expert_group=StandInGroup(2, 1), report=lambda _: None):
        model, _ = mlx_lm.utils.load(path)
    model_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert model_bytes < 0.75 * whole_bytes
    assert mx.get_peak_memory() - before <= model_bytes + largest_expert_array


def test_expert_parallel_refusals_inside_mlx_lm(models, tmp_path):
    # What the hook meets inside mlx-lm's loaders and cannot run: one
    # UsageError each (main prints it in one line), and the hooks removed.
    import mlx_lm.benchmark  # noqa: F401  (imported: its sharded_load is replaced)
    import mlx_lm.utils

    originals = (mlx_lm.utils.load_model, mlx_lm.utils.load_adapters,
                 mlx_lm.utils.sharded_load, mlx_lm.benchmark.sharded_load)
    adapter = lm_fixtures.write_adapter(tmp_path / "adapter", models["mixtral"])
    with lm.patched_loads(expert_group=StandInGroup(3), report=lambda _: None):
        assert mlx_lm.benchmark.sharded_load is not originals[3]
        with pytest.raises(lm.UsageError, match="the layer's 16 experts do not divide "
                                                "among 3 ranks"):
            mlx_lm.utils.load(str(models["qwen3_moe"]))
        with pytest.raises(lm.UsageError, match="and mlx-lm's --pipeline each split"):
            mlx_lm.benchmark.sharded_load(str(models["qwen3_moe"]), StandInGroup(3))
    with lm.patched_loads(expert_group=StandInGroup(2), report=lambda _: None):
        with pytest.raises(lm.UsageError, match="LoRA adapters are not split"):
            mlx_lm.utils.load(str(models["mixtral"]), adapter_path=str(adapter))
    assert (mlx_lm.utils.load_model, mlx_lm.utils.load_adapters,
            mlx_lm.utils.sharded_load, mlx_lm.benchmark.sharded_load) == originals


def test_expert_parallel_error_is_one_line(models, monkeypatch, capsys):
    # From the command line: experts that do not divide among the ranks (a
    # stand-in group of 3; nothing is run on it) end in one line, exit 1.
    monkeypatch.setattr(lm.mx.distributed, "init", lambda *args, **kwargs: StandInGroup(3))
    monkeypatch.setattr(lm, "_same_on_every_rank", lambda *args: None)
    assert lm.main(["--expert-parallel", "generate", "--model", str(models["qwen3_moe"]),
                    "--prompt", "hello", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "mlx-moe-plan: error: expert parallelism: the layer's 16 "
        "experts do not divide among 3 ranks (E = 16, N = 3)"), err
    assert "Traceback" not in err


def test_expert_parallel_in_one_process_warns_and_runs_patched(models, capsys):
    # Without mlx.launch the group is this one process: nothing to split.
    assert lm.main(["--expert-parallel", "generate", "--model", str(models["mixtral"]),
                    "--prompt", "hello", "--max-tokens", "2", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    assert "mlx-moe-plan: warning: --expert-parallel: this is one process (mlx.launch " \
           "starts several): the experts are not split, models run patched only" in err
    assert "patched 2 MoE layers of MixtralForCausalLM" in err and "sharded" not in err
