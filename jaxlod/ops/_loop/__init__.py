"""The recurrent engine: how `jaxlod.ops.dynamic_rnn` and every recurrent
layer run a recurrence over a LoDTensor. Its public names are
`jaxlod.ops`'s; the modules, one idea each:

  * `_plan`: `LoopPlan` and `default_plan`, how a loop runs on a backend;
  * `_spec`: the loop's static description (`LoopSpec`, its `Phase`\\ s and
    the `Residuals` a phase's forward pass keeps for the backward one);
  * `_phased_loop`: the phased loop and its custom VJP;
  * `_phased_rnn`: `phased_rnn`, a step function ranked, packed and run through it;
  * `_hoisted`: the `Separable` cell and `hoisted_rnn`, its input projection
    before the loop and its recurrent gradient after it;
  * `_fused`: `fused_rnn`, a separable cell's loop as one Pallas kernel;
  * `_dispatch`: `dynamic_rnn`, the front door that picks one of the three;
  * `_tune`: `tune_plan`, the fastest of several plans on a user's own
    step and batch, timed.
"""
