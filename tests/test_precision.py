"""The dtype policy (engines/devices.py): every (device, checkpoint dtype, CPU flags) case, and the
CPU flags reader."""

from __future__ import annotations

import pytest

from engines import devices
from engines.devices import checkpoint_dtype, choose_dtype, describe_cpu, has_native_bf16

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})  # the AMD EPYC hosts without AVX-512
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}  # Skylake / Cascade Lake: no bf16
AVX512_BF16 = AVX512 | {"avx512_bf16"}  # Zen 4, Cooper Lake
AMX = AVX512_BF16 | {"amx_bf16", "amx_int8", "amx_tile"}  # Sapphire Rapids
NEOVERSE_V1 = frozenset({"fp", "asimd", "sve", "bf16", "i8mm"})  # Graviton 3
NEOVERSE_N1 = frozenset({"fp", "asimd", "atomics"})  # Graviton 2


@pytest.mark.parametrize("checkpoint", [None, "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("cpu, expect", [(AVX2, "fp32"), (AVX512, "fp32"), (NEOVERSE_N1, "fp32"),
                                         (AVX512_BF16, "bf16"), (AMX, "bf16"), (NEOVERSE_V1, "bf16")])
def test_on_a_cpu_bf16_only_where_it_is_native(cpu, expect, checkpoint) -> None:
    for requested in (None, "auto"):
        choice = choose_dtype(requested, checkpoint, num_gpus=0, cpu=cpu)
        assert choice.dtype == expect
        assert ("natively" in choice.why) == (expect == "bf16")
        assert ("emulated" in choice.why) == (expect == "fp32")


@pytest.mark.parametrize("checkpoint, gpu_bf16, expect", [
    ("bfloat16", True, "bf16"), ("bfloat16", None, "bf16"), ("bfloat16", False, "fp16"),
    ("float16", True, "fp16"), ("float16", False, "fp16"),
    ("float32", True, "bf16"), ("float32", False, "fp16"), (None, True, "bf16"), ("torch.bfloat16", True, "bf16"),
])
def test_on_a_gpu_the_checkpoints_dtype(checkpoint, gpu_bf16, expect) -> None:
    for requested in (None, "auto"):
        choice = choose_dtype(requested, checkpoint, num_gpus=1, cpu=AVX2, gpu_bf16=gpu_bf16)
        assert choice.dtype == expect, (checkpoint, gpu_bf16)
    assert choose_dtype(None, checkpoint, num_gpus=1, cpu=AVX2, gpu_bf16=gpu_bf16).why


@pytest.mark.parametrize("requested", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("num_gpus, cpu", [(0, AVX2), (0, AMX), (1, AVX2)])
def test_an_explicit_dtype_always_wins(requested, num_gpus, cpu) -> None:
    choice = choose_dtype(requested, "bfloat16", num_gpus=num_gpus, cpu=cpu, gpu_bf16=False)
    assert (choice.dtype, choice.why) == (requested, f"option.dtype={requested}")
    assert str(choice) == f"{requested} (option.dtype={requested})"


def test_checkpoint_dtype_names() -> None:
    assert [checkpoint_dtype(n) for n in ("float32", "bfloat16", "float16", "torch.float16", None, "half", "bf16",
                                          "int8")] == ["fp32", "bf16", "fp16", "fp16", "fp32", "fp16", "bf16", "fp32"]


def test_cpu_flags_reads_the_x86_and_the_arm_line(tmp_path, monkeypatch) -> None:
    import builtins

    real_open = builtins.open
    for text, expect in [("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n", {"fpu", "avx2", "avx512_bf16"}),
                         ("processor\t: 0\nFeatures\t: fp asimd bf16\n", {"fp", "asimd", "bf16"}),
                         ("processor\t: 0\n", set())]:
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        monkeypatch.setattr(builtins, "open", lambda name, *a, **k: real_open(path if name == "/proc/cpuinfo" else name,
                                                                             *a, **k))
        devices.cpu_flags.cache_clear()
        try:
            assert devices.cpu_flags() == expect
        finally:
            monkeypatch.setattr(builtins, "open", real_open)
            devices.cpu_flags.cache_clear()
    assert has_native_bf16(devices.cpu_flags()) == any(f in devices.cpu_flags() for f in ("avx512_bf16", "amx_bf16",
                                                                                             "bf16"))


def test_describe_cpu_names_the_flags_that_decide_kernels() -> None:
    assert describe_cpu(AMX) == "avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_int8"
    assert describe_cpu(NEOVERSE_V1) == "asimd sve bf16 i8mm"
    assert describe_cpu(frozenset()) == "none of avx2/avx512/amx/neon"
