"""`dflash2 serve` and `dflash2 bench` flags: both spellings of each, and loud errors for choices that cannot work
(no model is loaded here: these fail or parse before any loading)."""
from __future__ import annotations

import subprocess

import pytest

from dflash2.cli.main import build_parser, main
from dflash2.cli.serve import check_parallel, llm_kwargs, server_config
from tests.integration.server_process import console_script

# Every server flag the design lists, with a value to pass (None: a switch).
SERVER_FLAGS = {
    "--model-path": "/m", "--host": "0.0.0.0", "--port": "9000", "--gpu-memory-utilization": "0.5",
    "--max-num-seqs": "8", "--max-model-len": "512", "--max-batch-size": "8", "--max-num-batched-tokens": "1024",
    "--prefill-chunk-size": "256", "--kv-cache-dtype": "auto", "--enforce-eager": None, "--swap-space": "0",
    "--streaming-timeout-ms": "500", "--metrics-port": "9100", "--tensor-parallel-size": "1",
    "--distributed-executor-backend": "uni", "--seed": "3", "--log-level": "debug", "--disable-log-stats": None,
    "--disable-log-requests": None, "--api-key": "k", "--log-tokens": None, "--max-request-bytes": "1000",
    "--kv-cache-memory": "8MiB", "--preemption-threshold": "50", "--priority-aging-seconds": "30",
    "--low-priority-values-first": None, "--max-queue-len": "7", "--stream-interval": "4",
    "--disable-overlap-schedule": None, "--single-process": None, "--pipeline-parallel-size": "1",
    "--disable-nagle": None, "--max-logprobs": "5", "--max-prompts-per-request": "9", "--shutdown-timeout": "5", "--step-timeout": "60",
}
BENCH_FLAGS = {
    "--url": "http://127.0.0.1:1", "--dataset": "d.jsonl", "--concurrency": "3", "--request-rate": "2.5",
    "--num-prompts": "7", "--timeout": "9", "--output": "r.json", "--max-tokens": "5", "--api-key": "k",
}


def argv(command: str, flags: dict[str, str | None], underscored: bool) -> list[str]:
    out = [command]
    for flag, value in flags.items():
        out.append("--" + flag[2:].replace("-", "_") if underscored else flag)
        if value is not None:
            out.append(value)
    return out


@pytest.mark.parametrize("command, flags", [("serve", SERVER_FLAGS), ("bench", BENCH_FLAGS)])
def test_every_flag_takes_both_spellings(command, flags):
    parser = build_parser()
    dashed = parser.parse_args(argv(command, flags, underscored=False))
    underscored = parser.parse_args(argv(command, flags, underscored=True))
    assert vars(dashed) == vars(underscored)


def test_model_dir_spelling_and_server_config():
    args = build_parser().parse_args(["serve", "--model_dir", "/models/x", *argv("serve", SERVER_FLAGS, False)[3:]])
    assert args.model == ["/models/x"]
    check_parallel(args)
    config = server_config(args)
    assert (config.host, config.port, config.api_key, config.streaming_timeout_ms, config.metrics_port) == (
        "0.0.0.0", 9000, "k", 500, 9100)
    assert config.disable_log_requests and config.log_tokens and config.disable_log_stats and config.single_process
    assert not server_config(build_parser().parse_args(["serve"])).single_process  # the engine's own process
    kwargs = llm_kwargs(args)
    assert (kwargs["max_num_seqs"], kwargs["max_model_len"], kwargs["prefill_chunk_size"]) == (8, 512, 256)
    assert kwargs["model"] == "/models/x" and "models" not in kwargs and config.model_aliases == ("/models/x",)


def test_several_models_from_repeated_flags_and_a_config_file(tmp_path):
    config = tmp_path / "models.yaml"
    config.write_text("models:\n  - {name: big, path: llama-3-8b, load_format: dummy, quantization: int4,"
                      " min_pool_share: 0.2}\n  - name: small\n    path: qwen3-0.6b\n    max_pool_share: 0.5\n")
    args = build_parser().parse_args(["serve", "--model", "a=/m/one.gguf", "--model", "/m/two", "--models_config",
                                      str(config)])
    kwargs = llm_kwargs(args)
    assert kwargs["model"] is None
    assert [(m.name, m.model, m.served_name()) for m in kwargs["models"]] == [
        ("a", "/m/one.gguf", "a"), (None, "/m/two", "two"), ("big", "llama-3-8b", "big"),
        ("small", "qwen3-0.6b", "small")]
    assert (kwargs["models"][2].quantization, kwargs["models"][2].min_pool_share) == ("int4", 0.2)
    assert server_config(args).model_aliases == ()


@pytest.mark.parametrize("flags, message", [
    (["--model", "/m/x", "--model", "/n/x"], "two models would be served as 'x'"),
    (["--model", "a=/m/x", "--model", "b=/m/y", "--served-model-name", "z"], "--served-model-name names a single"),
    (["--models-config", "/no/such.yaml"], "--models-config /no/such.yaml: No such file or directory"),
])
def test_bad_model_lists_are_refused_before_loading(flags, message):
    with pytest.raises(ValueError, match=message):
        llm_kwargs(build_parser().parse_args(["serve", *flags]))


@pytest.mark.parametrize("text, message", [
    ("[]", "expected a non-empty list of models"),
    ("- {name: a, path: /m, colour: red}", "model 0: unknown model option\\(s\\) colour"),
    ("- {name: a, path: /m, min_pool_share: 2}", "model 0: min_pool_share must be in \\[0, 1\\], got 2"),
    ("- {name: a, path: /m, quantization: int3}", "model 0: "),
    ("models: [unclosed", "is not valid JSON or YAML"),
])
def test_a_bad_models_config_names_the_problem(tmp_path, text, message):
    config = tmp_path / "models.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match=message):
        llm_kwargs(build_parser().parse_args(["serve", "--models-config", str(config)]))


def test_swap_space_reaches_the_engine():
    assert llm_kwargs(build_parser().parse_args(["serve", "--swap_space", "2"]))["swap_space"] == 2.0
    assert "swap_space" not in llm_kwargs(build_parser().parse_args(["serve"]))


def test_priority_flags_reach_the_engine_and_the_queue_bound_the_server():
    args = build_parser().parse_args(argv("serve", SERVER_FLAGS, underscored=True))
    kwargs = llm_kwargs(args)
    assert (kwargs["preemption_threshold"], kwargs["priority_aging_seconds"], kwargs["low_priority_values_first"],
            kwargs["kv_cache_memory"]) == (50, 30.0, True, "8MiB")
    assert server_config(args).max_queue_len == 7 and kwargs["stream_interval"] == 4
    assert (server_config(args).max_logprobs, server_config(args).max_prompts_per_request) == (5, 9)
    assert kwargs["overlap"] is False
    defaults = build_parser().parse_args(["serve"])
    assert "overlap" not in llm_kwargs(defaults)  # the engine's default: overlapped on the GPU
    assert (llm_kwargs(defaults)["preemption_threshold"], llm_kwargs(defaults)["priority_aging_seconds"],
            llm_kwargs(defaults)["low_priority_values_first"], server_config(defaults).max_queue_len,
            llm_kwargs(defaults)["stream_interval"]) == (1, None, False, 1024, 1)  # a finite queue by default
    assert (server_config(defaults).max_logprobs, server_config(defaults).max_prompts_per_request) == (20, 64)


def test_defaults_bind_localhost_and_bundled_model():
    args = build_parser().parse_args(["serve"])
    config = server_config(args)
    assert config.host == "127.0.0.1" and args.model is None
    kwargs = llm_kwargs(args)  # batch sizes left to the engine, which chooses them by device
    assert (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"], kwargs["prefill_chunk_size"]) == (None,) * 3


def test_max_batch_size_sizes_the_step_beside_max_num_seqs():
    """--max-batch-size caps the requests run in one step (the engine's max_num_seqs); given with --max-num-seqs
    (at least as large), that one bounds the requests the server holds."""
    args = build_parser().parse_args(["serve", "--max-batch-size", "8", "--max_num_seqs", "32"])
    assert llm_kwargs(args)["max_num_seqs"] == 8 and server_config(args).max_held_requests == 32
    args = build_parser().parse_args(["serve", "--max_batch_size", "8"])
    assert llm_kwargs(args)["max_num_seqs"] == 8 and server_config(args).max_held_requests is None
    args = build_parser().parse_args(["serve", "--max-num-seqs", "16"])
    assert llm_kwargs(args)["max_num_seqs"] == 16 and server_config(args).max_held_requests is None


def test_seed_spellings_parse():
    args = build_parser().parse_args(["serve", "--pipeline_parallel_size", "1", "--disable_nagle"])
    check_parallel(args)  # 1 is accepted
    assert args.disable_nagle is True
    convert = build_parser().parse_args(["convert", "--output_dir", "out", "--max_seq_len", "256", "--num_gpus", "1",
                                         "--verbose"])
    assert (convert.output_path, convert.calibration_max_tokens, convert.num_gpus, convert.log_level) == (
        "out", 256, 1, "info")


@pytest.mark.parametrize("flags, named", [
    (["--tensor-parallel-size", "2"], "tensor_parallel_size 2 does not divide the model's 9 attention heads"),
    (["--tensor_parallel_size", "4"], "tensor_parallel_size 4 does not divide the model's 9 attention heads"),
    (["--tensor-parallel-size", "0"], "tensor_parallel_size must be an integer >= 1"),
    (["--distributed-executor-backend", "uni", "--pp", "2"], "'uni' runs one process"),
    (["--ray-address", "10.0.0.1:6379", "--distributed-executor-backend", "mp"], "ray_address is for"),
    (["--tp", "3", "--enable-l3-cache", "--l3-cache-path", "/tmp", "--swap-space", "1"], "--enable-l3-cache"),
    (["--tp", "3", "--model", "a=/x", "--model", "b=/y"], "several models in one server"),
    (["--pipeline-parallel-size", "31"], "pipeline_parallel_size 31 is more than the model's 30 layers"),
    (["--enable-l3-cache"], "--enable-l3-cache"),
    (["--l3-cache-path", "/tmp"], "--l3-cache-path"),
    (["--enable-l3-cache", "--l3-cache-path", "/no/such/dir", "--swap-space", "1"], "--l3-cache-path"),
    (["--enable-l3-cache", "--l3-cache-path", "/tmp"], "--swap-space"),
    (["--enable-l3-cache", "--l3-cache-path", "/tmp", "--swap-space", "1", "--l3-cache-size", "lots"],
     "--l3-cache-size"),
    (["--swap-space", "-1"], "--swap-space"),
    (["--max-batch-size", "8", "--max-num-seqs", "4"], "--max-batch-size"),
    (["--preemption-threshold", "0"], "--preemption-threshold"),
    (["--priority-aging-seconds", "0"], "--priority-aging-seconds"),
    (["--max-queue-len", "0"], "--max-queue-len"),
    (["--stream-interval", "0"], "--stream-interval"),
])
def test_impossible_choices_are_startup_errors(flags, named, capsys):
    assert main(["serve", *flags]) != 0
    assert named in capsys.readouterr().err


def test_console_script_fails_loudly_before_loading_anything():
    result = subprocess.run([*console_script("dflash2-server", "serve"), "--tensor-parallel-size", "2"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "tensor_parallel_size 2 does not divide the model's 9 attention heads" in result.stderr


def test_bench_needs_a_server(tmp_path):
    result = subprocess.run([*console_script("dflash2-bench", "bench"), "--url", "http://127.0.0.1:9",
                             "--num-prompts", "2", "--timeout", "5", "--no-progress",
                             "--output", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0  # a run whose requests all failed still reports
    assert '"failed": 2' in (tmp_path / "r.json").read_text()
    assert '"error_rate": 1.0' in (tmp_path / "r.json").read_text()
