"""Each kernel of a decode step's adapter work, through slots and through rank pages, timed alone
on a GPU (issue 27): what `loraplex bench kernels --paged` sums per family, split by module group
(qkv, o, gate_up, down) and kernel (LoRA's shrink and expand, FLoRA's stack and combine), with
the per-token expand of lora_paged.py at 1, 2, 4 and 8 warps. Llama-3-8B shapes, 64 tokens each
with its own adapter, inputs of paged_kernels.make_inputs.

    python3 -P scripts/paged-kernels-per-kernel.py      (from the repository root, on a GPU)
"""

import torch

from loraplex.benchmarks import paged_kernels as pk
from loraplex.benchmarks.kernel_speed import time_per_call
from loraplex.kernels import adapter_families as fam
from loraplex.kernels import adapter_families_paged as famp
from loraplex.kernels import lora, lora_paged

GROUPS = ("qkv", "o", "gate_up", "down")


def kernels(family: str, g: int) -> list[tuple[str, object, object]]:
    """(name, through slots, through pages) for group index g; each takes one input set."""
    def weights(i):
        return i["pool"].view(i["x"].dtype)

    if family == "lora":
        return [
            ("shrink", lambda s: lora.lora_shrink(s[g]["x"], s[g]["a"], s[g]["slots"], s[g]["ranks"]),
             lambda s: lora_paged.lora_shrink_paged(s[g]["x"], weights(s[g]), s[g]["paged"].a_pages,
                                                    s[g]["slots"], s[g]["ranks"], s[g]["max_rank"])),
            ("expand", lambda s: lora.lora_expand(s[g]["y"], s[g]["shrunk"], s[g]["b"], s[g]["slots"],
                                                  s[g]["ranks"], s[g]["offsets"]),
             lambda s: lora_paged.lora_expand_paged(s[g]["y"], s[g]["shrunk"], weights(s[g]),
                                                    s[g]["paged"].b_pages, s[g]["slots"], s[g]["ranks"],
                                                    s[g]["offsets"])),
        ]
    return [
        ("stack", lambda s: fam.flora_stack(s[g]["x"], s[g]["a"], s[g]["ranks"], *s[g]["rows"],
                                            s[g]["per_slice"]),
         lambda s: famp.flora_stack_paged(s[g]["x"], weights(s[g]), s[g]["paged"].a_pages, s[g]["ranks"],
                                          *s[g]["rows"], s[g]["per_slice"])),
        ("combine", lambda s: fam.flora_combine(s[g]["products"], s[g]["bt"], s[g]["slots"], s[g]["ranks"],
                                                s[g]["bounds"], s[g]["offsets"], s[g]["num_rows"],
                                                s[g]["per_slice"]),
         lambda s: famp.flora_combine_paged(s[g]["products"], weights(s[g]), s[g]["paged"].b_pages,
                                            s[g]["slots"], s[g]["ranks"], s[g]["bounds"], s[g]["offsets"],
                                            s[g]["num_rows"], s[g]["per_slice"])),
    ]


def main() -> None:
    device = torch.device("cuda")
    print(f"per kernel, slots against pages, on {torch.cuda.get_device_name()}")
    for family in ("lora", "flora"):
        sets = [pk.make_inputs(pk.LLAMA3_8B, family, device, seed) for seed in range(2)]
        for g, group in enumerate(GROUPS):
            for s in sets:
                s[g]["shrunk"] = lora.lora_shrink(s[g]["x"], s[g]["a"], s[g]["slots"], s[g]["ranks"])
            for name, slots, paged in kernels(family, g):
                t_slots = time_per_call(slots, sets) * 1e6
                for warps in ((1, 2, 4, 8) if name == "expand" else (lora_paged.GEMV_WARPS,)):
                    default, lora_paged.GEMV_WARPS = lora_paged.GEMV_WARPS, warps
                    t_paged = time_per_call(paged, sets) * 1e6
                    lora_paged.GEMV_WARPS = default
                    print(f"{family:6s} {group:8s} {name:8s} slots {t_slots:8.2f} us  "
                          f"paged {t_paged:8.2f} us  x{t_paged / t_slots:5.2f}  warps {warps}", flush=True)
        del sets


if __name__ == "__main__":
    main()
