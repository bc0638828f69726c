"""What attention sinks (or a sparse cache) cost where users call them: the default model patched with a 64-token
softmax window, with and without 4 sinks, timed on its forward (a left-padded batch, the mask Transformers builds from
the tokenizer's attention_mask) and on ``generate`` (its own cache: a K/V cache for ``x^3/16``, the
RecurrentStateCache for ``x/1``), each against the same model without sinks in the same run (interleaved repeats,
medians, ratios). ``--sparse K``: window + 4 sinks against window + 4 sinks + ``sparse K (value_over_key)`` instead;
``--sparse K --scores A,B``: ``sparse K (A)`` against ``sparse K (B)`` (what a score that carries statistics costs);
``--sparse K --clusters C``: ``sparse K (prefix_kv_diff)`` against the same with ``+ clusters C`` beside it (their
codebooks fitted once, as a conversion fits them, and put back at each patch).

    OMP_NUM_THREADS=1 python scripts/conversion/bench_window_sinks.py --tokens 1024 --new-tokens 32
    OMP_NUM_THREADS=1 python scripts/conversion/bench_window_sinks.py --tokens 1024 --new-tokens 32 --sparse 256
    OMP_NUM_THREADS=1 python scripts/conversion/bench_window_sinks.py --tokens 4096 --new-tokens 32 --sparse 256 \
        --scores value_over_key,prefix_kv_diff --bases x/1
    OMP_NUM_THREADS=2 python scripts/conversion/bench_window_sinks.py --tokens 4096 --new-tokens 32 --sparse 256 \
        --clusters 256 --bases x/1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_knorm import patch, unpatch
from hf_knorm.assets.default_model import load_default_model
from hf_knorm.assets.texts import paul_graham_essays
from hf_knorm.conversion.clusters import add_clusters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the longer sequence of the batch")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generate adds to a prompt of --tokens / 2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sparse", type=int, default=0,
                        help="K > 0: compare window + 4 sinks with and without a sparse cache of K pairs")
    parser.add_argument("--scores", default=None,
                        help="A,B: with --sparse K, compare sparse K (A) with sparse K (B) (both beside window + 4 sinks)")
    parser.add_argument("--clusters", type=int, default=0,
                        help="C > 0: with --sparse K, compare sparse K (prefix_kv_diff) with and without C clusters")
    parser.add_argument("--bases", default="x^3/16,x/1", help="the families beside the window, comma-separated")
    args = parser.parse_args()
    if (args.scores or args.clusters) and not args.sparse:
        parser.error("--scores and --clusters change a sparse cache: give --sparse K too")

    model, tokenizer = load_default_model()
    model.eval()
    ids = tokenizer("\n\n".join(paul_graham_essays()[:3]), return_tensors="pt").input_ids[0, : args.tokens]
    batch = torch.stack([ids, ids])
    mask = torch.ones_like(batch)
    mask[1, : args.tokens // 4] = 0  # left padding in the second row
    prompt = ids[None, : args.tokens // 2]

    def forward():
        model(input_ids=batch, attention_mask=mask)

    def generate():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False)

    if args.clusters:
        cache = f" + sinks 4 + sparse {args.sparse} (prefix_kv_diff)"
        pair, header = (cache, f"{cache} + clusters {args.clusters}"), ("the cache", "+ clusters")
    elif args.scores:
        first, second = args.scores.split(",")
        pair = tuple(f" + sinks 4 + sparse {args.sparse} ({score})" for score in (first, second))
        header = (first, second)
    elif args.sparse:
        pair, header = (" + sinks 4", f" + sinks 4 + sparse {args.sparse} (value_over_key)"), ("4 sinks", "+ sparse")
    else:
        pair, header = ("", " + sinks 4"), ("without sinks", "with 4 sinks")

    fitted = {}

    def codebooks_for(model, base, suffix):
        """The codebooks of ``base + window 64 + suffix``, fitted once (add_clusters) and reused."""
        if (base, suffix) not in fitted:
            add_clusters(model, tokenizer, args.clusters)
            fitted[base, suffix] = [parameter.detach().clone() for parameter in _codebooks(model)]
        return fitted[base, suffix]

    print(f"| normalization | entry | {header[0]} | {header[1]} | ratio |\n|---|---|---:|---:|---:|")
    for base in args.bases.split(","):
        for name, call in (("forward, 2 x %d tokens, left-padded" % args.tokens, forward),
                           ("generate %d tokens after %d" % (args.new_tokens, args.tokens // 2), generate)):
            times = {suffix: [] for suffix in pair}
            for _ in range(args.repeats):
                for suffix in pair:
                    patch(model, f"{base} + softmax window 64{suffix}")
                    if "clusters" in suffix:
                        codebooks = codebooks_for(model, base, suffix)
                        for parameter, codebook in zip(_codebooks(model), codebooks):
                            parameter.data.copy_(codebook)
                    with torch.no_grad():
                        started = time.perf_counter()
                        call()
                        times[suffix].append(time.perf_counter() - started)
                    unpatch(model)
            before, after = (statistics.median(times[suffix]) for suffix in pair)
            print(f"| {base} + window 64 | {name} | {before:.2f} s | {after:.2f} s | {after / before:.3f}x |", flush=True)


def _codebooks(model):
    return [parameter for name, parameter in model.named_parameters() if name.endswith("cluster_codebook")]


if __name__ == "__main__":
    main()
