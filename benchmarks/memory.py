"""Memory, communication and step time per rank for ZeRO stages 0-3 at d = 1, 2, 4, our FSDP
in mixed precision, and our FSDP against PyTorch's FSDP2, on gloo.

    python -m benchmarks.memory [--degrees 1 2 4] [--steps 8] [--rounds 3] [--hidden 128]
                                [--layers 2]

The model is notebook 08's (`helpers.configs.SMALL`: notebook 07's decoder,
Ψ = 464,128 at the defaults); fp32 parameters, AdamW.

Definitions (rank 0's numbers; every rank holds the same, up to the last shard's padding):
* measured_bytes: parameters + gradients + optimizer state after the last step, before
  zero_grad, from the tensors' storages (each once); formula_bytes: the fp32 ZeRO formula
  (16Ψ, 8Ψ + 8Ψ/d, 4Ψ + 12Ψ/d, 16Ψ/d); rel_error = measured / formula − 1.
* peak_bytes: the highest bytes live during that step (profiler allocator records, on top of
  what was allocated when it began).
* comm_bytes: bytes handed to the collectives in that step, elements × itemsize of each
  collective's buffer (nccl-tests' n); a ring moves n × bus factor of them per rank.
* step_s: median over rounds of the median step (forward, backward, optimizer step, barrier
  on both sides) of each round; the stages take turns within a round.
* fsdp_vs_torch_step: our FSDP's step_s over FSDP2's (`fully_shard` per block and on the
  model), measured in turns in the same rounds; the worse of d = 2 and d = 4.
* Mixed-precision rows (stage 3, "precision": "bf16, reduce fp32" or "bf16, reduce bf16"; the
  ZeRO rows say "fp32"): bf16 forward and backward on fp32 masters. formula_bytes is the
  lecture's (2 + 2 + 12)Ψ/d, or (2 + 4 + 12)Ψ/d with the gradients reduced in fp32;
  formula_comm_bytes what the two all-gathers (bf16) and the reduce-scatter hand to gloo,
  (2·2 + 2 or 4)Ψ. vs_fp32_step: step_s over the fp32 stage-3 row's: on a CPU bf16 runs at
  about fp32's speed, not at the multiple a GPU's tensor cores give it.
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics

from helpers.configs import SMALL
import torch

from helpers.cost.memory import STAGES, mixed_precision_bytes, zero_memory_for
from helpers.labs import memory as mr
from helpers.parallel.fsdp import MixedPrecision
from helpers.ranks import LiveRanks, cpu_cores

PRECISIONS = {"bf16, reduce fp32": MixedPrecision(torch.bfloat16, torch.float32),
              "bf16, reduce bf16": MixedPrecision(torch.bfloat16, torch.bfloat16)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=SMALL.hidden)
    parser.add_argument("--layers", type=int, default=SMALL.layers)
    args = parser.parse_args(argv)
    if args.steps < 3 or args.rounds < 1:
        parser.error("--steps must be >= 3 and --rounds >= 1")
    config = SMALL.with_(hidden=args.hidden, layers=args.layers)
    for d in args.degrees:
        for stage in STAGES:
            mr.check_run(stage, d, config, args.steps)
    psi = config.parameters
    print(f"decoder h={config.hidden}, {config.layers} blocks, Ψ = {psi:,}; fp32 AdamW; "
          f"gloo on loopback; {cpu_cores()} CPU cores")
    rows, ratios = [], {}
    with LiveRanks(max(args.degrees)) as live:
        for d in args.degrees:
            live.resize(d)
            steps: dict[str, list[float]] = {}
            last: dict[int, mr.StageRun] = {}
            for _ in range(args.rounds):
                for stage in STAGES:
                    run = live.run(mr.train_stage, stage, args.steps, config)[0]
                    # the first step warms up (allocations, gloo's buffers): left out
                    steps.setdefault(str(stage), []).append(statistics.median(run.step_s[1:]))
                    last[stage] = run
                for name, precision in PRECISIONS.items():
                    run = live.run(mr.train_stage, 3, args.steps, config, precision=precision)[0]
                    steps.setdefault(name, []).append(statistics.median(run.step_s[1:]))
                    last[name] = run
                if d > 1:
                    torch_run = live.run(mr.train_torch_fsdp, args.steps, config)[0]
                    steps.setdefault("torch", []).append(statistics.median(torch_run.step_s[1:]))
            for stage in STAGES:
                run = last[stage]
                formula = zero_memory_for(psi, d, stage).total
                row = {"stage": stage, "d": d, "precision": "fp32",
                       "measured_bytes": run.state.total,
                       "formula_bytes": round(formula),
                       "rel_error": round(mr.rel_error(run.state.total, formula), 6),
                       "peak_bytes": run.peak_bytes, "comm_bytes": run.comm_bytes,
                       "step_s": round(statistics.median(steps[str(stage)]), 6)}
                rows.append(row)
                print(f"stage {stage} d={d}: state {run.state.total / 1e6:.3f} MB "
                      f"(formula {formula / 1e6:.3f}, {row['rel_error']:+.2%}), peak "
                      f"{run.peak_bytes / 1e6:.3f} MB, handed to collectives "
                      f"{run.comm_bytes / (4 * psi):.3f}·4Ψ bytes, step {row['step_s'] * 1e3:.1f} ms")
            for name, precision in PRECISIONS.items():
                run = last[name]
                formula = mr.mixed_formula(psi, d, precision).total
                compute, reduce, _ = mixed_precision_bytes(mr.dtype_name(precision.compute_dtype),
                                                           mr.dtype_name(precision.reduce_dtype))
                step_s = statistics.median(steps[name])
                row = {"stage": 3, "d": d, "precision": name, "measured_bytes": run.state.total,
                       "formula_bytes": round(formula),
                       "rel_error": round(mr.rel_error(run.state.total, formula), 6),
                       "peak_bytes": run.peak_bytes, "comm_bytes": run.comm_bytes,
                       "formula_comm_bytes": (2 * compute + reduce) * psi,
                       "step_s": round(step_s, 6),
                       "vs_fp32_step": round(step_s / statistics.median(steps["3"]), 3)}
                rows.append(row)
                print(f"FSDP {name} d={d}: state {run.state.total / 1e6:.3f} MB (formula "
                      f"{formula / 1e6:.3f}, {row['rel_error']:+.2%}), peak "
                      f"{run.peak_bytes / 1e6:.3f} MB, handed to collectives "
                      f"{run.comm_bytes / psi:.3f}·Ψ bytes (formula "
                      f"{row['formula_comm_bytes'] / psi:.0f}·Ψ), step {step_s * 1e3:.1f} ms "
                      f"({row['vs_fp32_step']:.2f}× fp32's)")
            if d > 1:
                torch_s = statistics.median(steps["torch"])
                ratios[d] = statistics.median(steps["3"]) / torch_s
                print(f"  FSDP2 (fully_shard) d={d}: step {torch_s * 1e3:.1f} ms; ours / theirs "
                      f"{ratios[d]:.2f}")
    record = {"results": rows,
              "fsdp_vs_torch_step": round(max(ratios.values()), 3) if ratios else None}
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
