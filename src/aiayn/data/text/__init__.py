"""Data of the text tasks: monolingual text for language models (``lm``, and ``mlm``
pre-training on the same data) and labelled text for classification (``classify``).

Layout written by :func:`~aiayn.data.text.prepare.prepare_text` (``aiayn prepare --task
lm|classify``; see ``docs/data.md``)::

    DATA_DIR/manifest.json            written last; "kind": "text", "task": "lm" | "classify"
    DATA_DIR/spm.model                sentencepiece model, <mask> at MASK_ID = 4
    DATA_DIR/{split}.txt              the kept texts, one per line (labels removed)
    DATA_DIR/{split}.txt.bin          flat token ids of all lines (dtype in the manifest)
    DATA_DIR/{split}.txt.idx.npy      int64 offsets, n + 1 entries: line i is bin[o[i]:o[i+1]]
    DATA_DIR/{split}.txt.len.npy      int32 lengths (tokens, no BOS/EOS)
    DATA_DIR/{split}.labels.npy       classify: int64 class of every line (manifest "labels")

* :mod:`.prepare`: text files to DATA_DIR.
* :mod:`.corpus`: :class:`TextCorpus`, one split read through memory maps.
* :mod:`.examples`: :class:`TextExamples` (the lm, mlm and classify examples and batches) and
  :func:`mask_tokens` (BERT's masking).
* :mod:`.bible`: the embedded Bible corpus as lm and classify data.
"""

from aiayn.data.text.bible import prepare_bible_text
from aiayn.data.text.corpus import TextCorpus
from aiayn.data.text.examples import TextExamples, mask_tokens
from aiayn.data.text.prepare import prepare_text

__all__ = ["TextCorpus", "TextExamples", "mask_tokens", "prepare_bible_text", "prepare_text"]
