"""Write the binned sequence-length distributions shipped with concertina_hf.

    python benchmarks/data/make_distributions.py

We cannot download the corpora the paper measured, so these are CONSTRUCTED, not measured:
bin probabilities chosen by hand to match the few published statements about them and a
typical log-normal-like shape elsewhere. See benchmarks/README.md. Output:
src/concertina_hf/tools/assets/distributions/{github,commoncrawl}.json (inside the package, so
``concertina plan --distribution github`` works from any install).
"""

from __future__ import annotations

import json
import pathlib

OUT = pathlib.Path(__file__).resolve().parents[2] / "src" / "concertina_hf" / "tools" / "assets" / "distributions"
EDGES = [16, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
PAPER = ("InfiniPipe / Concertina: Data-Centric Elastic Pipeline Parallelism for Efficient "
         "Long-Context LLM Training, arXiv:2509.21275")

DISTS = {
    "github": {
        "probabilities": [0.10, 0.10, 0.14, 0.17, 0.16, 0.13, 0.09, 0.065, 0.0395, 0.004, 0.0015],
        "facts_used": [
            "most sequences are under 16K tokens (here 89%) [arXiv:2509.21275]",
            "under 0.6% of sequences exceed 64K tokens (here 0.55%) [arXiv:2509.21275]",
        ],
        "assumed": "the split of mass among bins below 16K and between 16K and 64K, and the "
                   "longest length (256K), are our assumptions, not measurements",
    },
    "commoncrawl": {
        "probabilities": [0.22, 0.20, 0.20, 0.16, 0.10, 0.06, 0.035, 0.017, 0.0065, 0.0012, 0.0003],
        "facts_used": [
            "CommonCrawl is shorter-tailed than GitHub [arXiv:2509.21275, qualitatively]",
        ],
        "assumed": "every bin probability is our assumption (median web document ~0.6K tokens, "
                   "0.15% above 64K); only the shape 'shorter-tailed than github' is from the source",
    },
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, d in DISTS.items():
        probs = d["probabilities"]
        assert len(probs) == len(EDGES) - 1 and abs(sum(probs) - 1) < 1e-9, name
        doc = {
            "name": name,
            "unit": "tokens",
            "constructed_not_measured": True,
            "description": (
                f"Binned {name} sequence-length distribution CONSTRUCTED by hand (we cannot download "
                "the paper's data) to match published statements; bin i covers "
                "[bin_edges[i], bin_edges[i+1]) tokens, sampled log-uniformly inside a bin."
            ),
            "source": PAPER,
            "facts_used": d["facts_used"],
            "assumed": d["assumed"],
            "generated_by": "benchmarks/data/make_distributions.py",
            "bin_edges": EDGES,
            "probabilities": probs,
        }
        (OUT / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {OUT / (name + '.json')}")


if __name__ == "__main__":
    main()
