"""A test-only port: the numpy contract whose whole run (the `trace` verb) loads layer 2's
feed-forward norm (post_attention_layernorm) from the last layer's block, as a port that maps
GGUF blocks in file-name order (`blk.10` read as layer 2) would. Its `layer` verb loads the one
layer it runs, correctly, so it does not have the defect: in isolation every layer matches the
reference, and only the whole run is wrong — from layer 2, whose input still agrees.

    whole_run_only.py {verb} {args}

`gate bisect` and `gate run port`'s localisation must name it as the layer verb disagreeing with
the whole run at layer 02, never as a divergence that accumulates. Not for real use.
"""

import sys

from tracegate_contract import __main__ as cli
from tracegate_contract import run as contract_run

WRONG_LAYER = 2

_orig_open = contract_run.open_model


def _whole_run_model(model_dir):
    m = _orig_open(model_dir)
    last = m.layers[-1].post_attention_layernorm
    m.layers[WRONG_LAYER].post_attention_layernorm = last.copy()
    return m


def main(argv):
    if argv[:1] == ["trace"]:
        contract_run.open_model = _whole_run_model  # run.py calls it through the module
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
