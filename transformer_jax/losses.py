"""The training objective and the metrics, shared by the train and eval steps.

Everything is returned as sums plus a token count, so that metrics aggregate correctly over
microbatches, devices, hosts and evaluation batches: divide only at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def compute_metrics(logits: Array, targets: Array, weights: Array,
                    label_smoothing: float = 0.1) -> dict[str, Array]:
  """Label-smoothed cross entropy (the objective) and plain cross entropy (for perplexity).

  Label smoothing follows Szegedy et al., as the paper cites it: the target distribution is
  (1 - eps) on the reference token plus eps spread uniformly over the whole vocabulary.

  Args:
    logits: [batch, length, vocab] in any float dtype; computed on in float32.
    targets: [batch, length] reference ids.
    weights: [batch, length], 1 on tokens that count (non-padding), 0 elsewhere.
    label_smoothing: eps.

  Returns:
    Sums over the counted tokens: 'loss' (label-smoothed cross entropy, the objective),
    'nll' (plain cross entropy: perplexity = exp(nll / tokens)), 'correct' (argmax hits),
    and 'tokens' (their number).
  """
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  smoothed = (1.0 - label_smoothing) * nll - label_smoothing * log_probs.mean(axis=-1)
  weights = weights.astype(jnp.float32)
  correct = (jnp.argmax(log_probs, axis=-1) == targets).astype(jnp.float32)
  return {
      'loss': jnp.sum(smoothed * weights),
      'nll': jnp.sum(nll * weights),
      'correct': jnp.sum(correct * weights),
      'tokens': jnp.sum(weights),
  }
