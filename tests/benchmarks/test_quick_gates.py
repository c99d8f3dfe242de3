"""The benchmarks' correctness gates at tiny shapes (`--quick`), so the scripts cannot rot while no GPU runs them,
and the offline sm_90 compile reports. Subprocesses: each benchmark switches on the Triton interpreter before
importing Triton."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["benchmarks.short_conv", "benchmarks.cross_entropy",
                                    "benchmarks.grouped_gemm_triton"])
def test_quick_gate_passes(module):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the quick gate runs on CPU even on a GPU machine
    run = subprocess.run([sys.executable, "-m", module, "--quick"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAIL" not in run.stdout


def spill_report(script: str) -> list[str]:
    """The kernel rows of an offline sm_90 spill report (`benchmarks/<script>`), each checked to build and to spill
    at most 1 KB per thread; skips where the triton wheel has no bundled ptxas."""
    ptxas = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton wheel has no bundled ptxas")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines()[1:] if line.strip()]
    for line in rows:
        stores = int(line.rsplit("/", 1)[0].split()[-1])
        assert stores <= 1024, line
    return rows


def test_kernels_compile_for_sm90_without_large_spills():
    """Compiled offline for the H200 (no GPU): every kernel builds, and none spills more than 1 KB per thread
    (the short-conv backward once spilled 12.8 KB at a tiling that looked harmless)."""
    assert len(spill_report("kernel_spills.py")) >= 6


def test_kda_kernels_compile_for_sm90():
    """Every KDA chunk kernel builds for the H200 at its TUNING settings (no GPU; the interpreter tests cannot see a
    kernel that fails to compile), none spilling more than 1 KB per thread."""
    names = {row.split()[0] for row in spill_report("kda_spills.py")}
    assert names >= {"_prep_gate", "_prep_intra", "_prep_solve", "_prep_wu", "_state", "_state_ut", "_state_bwd",
                     "_bwd_vk", "_bwd_vv", "_bwd_k_block", "_bwd_gate", "_bwd_norms"}, names


def test_ncu_source_report_reads_an_export(tmp_path):
    """`benchmarks/ncu_source.py` on a small Nsight Compute source export of two kernels: the chosen section's
    opcode shares and its top instructions."""
    header = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
              '"stall_long_sb","stall_wait","stall_barrier"')
    rows = [("0x10", "      LDG.E R2, [R4.64]", 60, 50, 50, 5, 0), ("0x20", "      FFMA R1, R2, R3, R1", 30, 20, 0, 25, 0),
            ("0x30", "  @P0 BAR.SYNC 0x0", 10, 10, 0, 0, 10)]
    section = "\n".join([header] + [",".join(f'"{v}"' for v in r) for r in rows])
    export = tmp_path / "source.csv"
    export.write_text(f'"Kernel Name","_other",\n{header}\n"0x0","NOP","1","0","0","0","0"\n'
                      f'"Kernel Name","_state",\n{section}\n')
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ncu_source.py"), str(export), "2", "--top", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith('"_state"') and "samples 100" in lines[0], lines[0]
    shares = {line.split()[0]: float(line.split()[1].rstrip("%")) for line in lines[1:4]}
    assert shares == {"LDG": 60.0, "FFMA": 30.0, "BAR": 10.0}, run.stdout
    assert [line.split()[0] for line in lines if line.split()[0].isdigit()] == ["0", "1"], run.stdout
