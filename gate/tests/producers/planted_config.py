"""A test-only producer: the oracle (python -m tracegate_oracle) with a planted configuration
defect, patched into the loaded model as planted_oracle.py patches a weight — every RMSNorm's
epsilon times F, or the rotary embedding's frequencies recomputed for another base theta. The
checkpoint on disk is untouched (the weights digest is the clean one, as a port's would be).

  planted_config.py --eps-scale F {verb|serve} {args}      # e.g. 10 or 0.1
  planted_config.py --rope-theta T {verb|serve} {args}     # e.g. 10000 for a config's 100000

Measured against the noise run in fixtures/policy/MEASUREMENTS.md, "Defects against the noise
run (bf16, f16, q8)".
"""

import sys

from tracegate_oracle import capture as cp
from tracegate_oracle import cli
from tracegate_oracle.families import resolve


def main(argv: list[str]) -> int:
    try:
        flag, value, *rest = argv
        value = float(value)
        assert flag in ("--eps-scale", "--rope-theta")
    except (ValueError, IndexError, AssertionError):
        print(
            "usage: planted_config.py --eps-scale F | --rope-theta T VERB ARGS...", file=sys.stderr
        )
        return 2
    load = cp.load_model

    def planted(model_dir, rc):
        import torch

        model = load(model_dir, rc)
        with torch.no_grad():
            if flag == "--eps-scale":
                n = 0
                for m in model.modules():
                    if hasattr(m, "variance_epsilon"):
                        m.variance_epsilon *= value
                        n += 1
                assert n > 0, "no RMSNorm (variance_epsilon) found"
            else:
                rot = resolve(model).rotary
                dim = rot.inv_freq.numel() * 2
                inv = 1.0 / (value ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
                rot.inv_freq.copy_(inv.to(rot.inv_freq.dtype))
                rot.original_inv_freq.copy_(inv.to(rot.original_inv_freq.dtype))
        return model

    cp.load_model = planted  # the CLI loads through the module attribute
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
