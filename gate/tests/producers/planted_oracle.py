"""A test-only producer: the oracle (transformers' own model classes, python -m tracegate_oracle)
with one planted defect — layer L's MLP down projection multiplied by S after loading, so its
mlp_out is S times too large — answering the same verbs, `serve` included (docs/producers.md).
The checkpoint on disk is untouched, so the weights digest is the clean one, as a port's would be.

  planted_oracle.py --scale-mlp L:S {verb|serve} {args}

`gate bisect`'s negative control for a scale error found in isolation by the bf16 policy's
`path: layer` rule (fixtures/policy/MEASUREMENTS.md, "Scale error", "A trained model"): with
`--dtype bf16` in the template the weight is scaled in bf16 (each product rounded), a scale of S
up to that rounding.
"""

import sys

from tracegate_oracle import capture as cp
from tracegate_oracle import cli
from tracegate_oracle.families import resolve


def main(argv: list[str]) -> int:
    try:
        flag, spec, *rest = argv
        layer, scale = int(spec.split(":")[0]), float(spec.split(":")[1])
        assert flag == "--scale-mlp"
    except (ValueError, IndexError, AssertionError):
        print("usage: planted_oracle.py --scale-mlp L:S VERB ARGS...", file=sys.stderr)
        return 2
    load = cp.load_model

    def planted(model_dir, rc):
        import torch

        model = load(model_dir, rc)
        with torch.no_grad():
            resolve(model).layers[layer].mlp.down_proj.weight.mul_(scale)
        return model

    cp.load_model = planted  # the CLI loads through the module attribute
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
