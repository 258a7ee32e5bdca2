"""The training objective and the metrics, shared by the train and eval steps.

The objective is the paper's: cross entropy with label smoothing (eps = 0.1, section 5.4).
Everything is returned as sums plus a token count, so that metrics aggregate correctly over
microbatches, devices, hosts and evaluation batches: divide only at the end. The per-token
losses come from `kernels.cross_entropy`, whose backward never stores a float32
[batch, length, vocab] array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax.model.kernels import cross_entropy

Array = jax.Array


def compute_metrics(
    logits: Array,
    targets: Array,
    weights: Array,
    label_smoothing: float = 0.1,
    logit_sums: Array | None = None,
) -> dict[str, Array]:
  """Label-smoothed cross entropy (the objective) and plain cross entropy (for perplexity).

  Args:
    logits: [batch, length, vocab] in any float dtype; computed on in float32.
    targets: [batch, length] reference ids.
    weights: [batch, length], 1 on tokens that count (non-padding), 0 elsewhere.
    label_smoothing: eps.
    logit_sums: [batch, length] float32, each token's sum of logits over the vocabulary
      (`cross_entropy.token_losses_given_sums`); None: summed from the logits.

  Returns:
    Sums over the counted tokens: 'loss' (label-smoothed cross entropy, the objective),
    'nll' (plain cross entropy: perplexity = exp(nll / tokens)), 'correct' (tokens whose
    reference has the largest logit) and 'tokens' (their number).
  """
  if logit_sums is None:
    smoothed, nll, correct = cross_entropy.token_losses(logits, targets, label_smoothing)
  else:
    smoothed, nll, correct = cross_entropy.token_losses_given_sums(
        logits, targets, logit_sums, label_smoothing
    )
  weights = weights.astype(jnp.float32)
  return {
      'loss': jnp.sum(smoothed * weights),
      'nll': jnp.sum(nll * weights),
      'correct': jnp.sum(correct * weights),
      'tokens': jnp.sum(weights),
  }
