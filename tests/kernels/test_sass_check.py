"""tools/sass_check.py: the per-token kernels' SASS keeps the post-wait loads together and the exps branch-free.

The checker's rules are tested here on small listings (CPU, in CI). Where nvcc and nvdisasm are present (CI and
the development machine: nvdisasm from the nvidia-cuda-nvdisasm wheel), the kernels are compiled for sm_90 with
the library's flags and every instance is checked — no GPU needed, so a schedule regression fails CI. On the
H200 machine the built library itself is checked too (`pytest -m gpu`)."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import attnres
from helpers import ROOT

_TOOL = ROOT / "tools" / "sass_check.py"
_spec = importlib.util.spec_from_file_location("sass_check", _TOOL)
sass_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_check)


def _listing(body: list[str], name: str = "_ZN7attnres6detail25attn_res_per_token_kernelILi2EE") -> str:
    lines = [f"\t\tFunction : {name}"]
    lines += [f"        /*{16 * i:04x}*/                   {s} ;" for i, s in enumerate(body)]
    return "\n".join(lines) + "\n"


_EXPS = ["MUFU.EX2 R40, R41", "FADD R42, R40, R43", "MUFU.EX2 R44, R45"]


def _check(body: list[str]) -> tuple[bool, str]:
    funcs = sass_check.functions(_listing(body))
    assert len(funcs) == 1
    return sass_check.check(next(iter(funcs.values())))


def test_loads_issued_together_pass():
    ok, detail = _check(["@P0 LDG.E.128 R8, desc[UR4][R2.64]", "ACQBULK", "@P1 LDG.E.128 R12, desc[UR4][R4.64]",
                         "IMAD R3, R3, UR10, R0", "@P0 LDG.E.128 R16, desc[UR4][R6.64]",
                         "LOP3.LUT R20, R20, R12, RZ, 0xfc, !PT", "BAR.SYNC.DEFER_BLOCKING 0x0", *_EXPS])
    assert ok, detail


def test_use_between_the_loads_fails():
    # The 6a81f52 schedule: the merge reads the first load's register before the second load is issued.
    ok, detail = _check(["ACQBULK", "@P1 LDG.E.128 R4, desc[UR4][R28.64]", "@!P3 LOP3.LUT R12, R12, R4, RZ, 0xfc",
                         "@P0 LDG.E.128 R28, desc[UR4][R32.64]", "BAR.SYNC.DEFER_BLOCKING 0x0", *_EXPS])
    assert not ok and "touches R4" in detail


def test_overwriting_a_loaded_register_fails():
    # Reusing a loaded register (here as an address) means its value was already consumed.
    ok, detail = _check(["ACQBULK", "@P1 LDG.E.128 R4, desc[UR4][R28.64]", "IMAD.WIDE.U32 R6, R3, UR5, R36",
                         "@P0 LDG.E.128 R28, desc[UR4][R32.64]", "BAR.SYNC.DEFER_BLOCKING 0x0", *_EXPS])
    assert not ok and "R6" in detail


def test_a_reducing_barrier_closes_the_window():
    # __syncthreads_count (BAR.RED) ends the window like BAR.SYNC: a use before a load past it is not a finding,
    # a use between two loads before it is.
    ok, detail = _check(["ACQBULK", "@P1 LDG.E.128 R4, desc[UR4][R28.64]", "BAR.RED.POPC RZ, PT, 0x0",
                         "LOP3.LUT R12, R12, R4, RZ, 0xfc, !PT", "LDG.E R30, desc[UR4][R32.64]", *_EXPS])
    assert ok and "1 loads" in detail, detail
    ok, detail = _check(["ACQBULK", "@P1 LDG.E.128 R4, desc[UR4][R28.64]", "LOP3.LUT R12, R12, R4, RZ, 0xfc, !PT",
                         "@P0 LDG.E.128 R28, desc[UR4][R32.64]", "BAR.RED.POPC RZ, PT, 0x0", *_EXPS])
    assert not ok and "touches R4" in detail


def test_a_64_bit_operand_covers_two_registers():
    ok, detail = _check(["ACQBULK", "@P1 LDG.E.128 R4, desc[UR4][R28.64]", "@P0 LDG.E.128 R8, desc[UR4][R6.64]",
                         "BAR.SYNC.DEFER_BLOCKING 0x0", *_EXPS])
    assert not ok and "R6" in detail


def test_branch_between_exps_fails():
    ok, detail = _check(["ACQBULK", "@P1 LDG.E.128 R4, desc[UR4][R28.64]", "BAR.SYNC.DEFER_BLOCKING 0x0",
                         "MUFU.EX2 R40, R41", "@P2 BRA `(.L_x_1)", "MUFU.EX2 R44, R45"])
    assert not ok and "1 branches among 2 exps" in detail


def test_missing_wait_or_exps_fail():
    assert not _check(["LDG.E.128 R4, desc[UR4][R28.64]", *_EXPS])[0]
    assert not _check(["ACQBULK", "LDG.E.128 R4, desc[UR4][R28.64]", "BAR.SYNC.DEFER_BLOCKING 0x0"])[0]


def test_only_per_token_kernels_are_read():
    text = _listing(["ACQBULK"], name="_ZN7attnres6detail19moe_finalize_kernelEv") + _listing(
        ["ACQBULK", "@P1 LDG.E.128 R4, desc[UR4][R28.64]", "BAR.SYNC.DEFER_BLOCKING 0x0", *_EXPS])
    funcs = sass_check.functions(text)
    assert list(funcs) == ["_ZN7attnres6detail25attn_res_per_token_kernelILi2EE"]
    assert sass_check.check(funcs[next(iter(funcs))])[0]


_REPO = ROOT


def _cuda_tool(name: str) -> str | None:
    for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if d and Path(d, "bin", name).exists():
            return str(Path(d, "bin", name))
    found = shutil.which(name)
    if found or name != "nvdisasm":
        return found
    spec = importlib.util.find_spec("nvidia")  # the nvidia-cuda-nvdisasm wheel: nvidia/cu*/bin/nvdisasm
    for root in (spec.submodule_search_locations or []) if spec else []:
        hits = sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm")))
        if hits:
            return hits[-1]
    return None


def _library_cuda_flags() -> list[str]:
    """The CUDA compile options of cpp/src/CMakeLists.txt (one source of truth for the flags that shape SASS)."""
    text = (_REPO / "cpp" / "src" / "CMakeLists.txt").read_text()
    m = re.search(r"\$<\$<COMPILE_LANGUAGE:CUDA>:([^>]*)>", text)
    assert m, "cpp/src/CMakeLists.txt: no CUDA compile options found"
    return m.group(1).split()


def _assert_every_instance_passes(sass: str, minimum: int = 28) -> None:
    funcs = sass_check.functions(sass)
    assert len(funcs) >= minimum, f"expected every per-token instance, found {len(funcs)}"
    failures = {name: detail for name, insns in funcs.items() for ok, detail in [sass_check.check(insns)] if not ok}
    assert not failures, failures


@pytest.mark.skipif(_cuda_tool("nvcc") is None, reason="no nvcc on this machine")
@pytest.mark.skipif(_cuda_tool("nvdisasm") is None, reason="no nvdisasm (CUDA toolkit or nvidia-cuda-nvdisasm wheel)")
@pytest.mark.parametrize("source,instances", [("attn_res_launch.cu", 60), ("attn_res_mix_add_instances.cu", 12)] + [
    (f"attn_res_exact_instances_{name}.cu", 28) for name in ("mix", "add", "mix_add", "fp8_norm", "fp8_add", "fp8_add2")])
def test_compiled_kernels_pass(tmp_path, source, instances):
    """Compile a file of per-token instances for sm_90 as the library build does and check every instance: the
    launcher's (the modes with a norm, and attn_res without an addend, N's bucket), attn_res with addends', and
    split_k's cluster instances per exact N (N = 3..16, two variants a file). 240 in all."""
    include = tmp_path / "include" / "attnres"
    include.mkdir(parents=True)
    template = (_REPO / "cpp" / "include" / "attnres" / "version.hpp.in").read_text()
    (include / "version.hpp").write_text(
        template.replace("@PROJECT_VERSION@", "0.0.0").replace("@ATTNRES_WITH_CUDA_01@", "1"))
    cubin = tmp_path / (source + ".cubin")
    cmd = [_cuda_tool("nvcc"), "-std=c++17", "-O3", "-arch=sm_90", *_library_cuda_flags(),
           f"-I{_REPO / 'cpp' / 'include'}", f"-I{_REPO / 'cpp' / 'src'}", f"-I{tmp_path / 'include'}",
           "-cubin", str(_REPO / "cpp" / "src" / "cuda" / source), "-o", str(cubin)]
    subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    sass = subprocess.run([_cuda_tool("nvdisasm"), "-c", str(cubin)], check=True, timeout=300,
                          capture_output=True, text=True).stdout
    _assert_every_instance_passes(sass, instances)


@pytest.mark.gpu
@pytest.mark.skipif(not attnres.backend_info()["cuda_backend"], reason="attnres was built without the CUDA backend")
@pytest.mark.skipif(_cuda_tool("cuobjdump") is None, reason="no cuobjdump (CUDA toolkit) on this machine")
def test_built_library_passes(tmp_path):
    from attnres import _C

    sass = tmp_path / "attnres.sass"
    with open(sass, "w") as f:
        subprocess.run([_cuda_tool("cuobjdump"), "-sass", _C.__file__], stdout=f, check=True, timeout=300)
    _assert_every_instance_passes(sass.read_text())
