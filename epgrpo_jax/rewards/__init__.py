"""Answer extraction, math answer checking and parallel reward scoring.

config (RewardConfig, RewardResult), answers (extraction, normalisation, the fast path,
Gold), verify (math-verify and the worker's checker), custom (`reward.function`), pool
(CheckPool: killable worker processes), worker (the worker process), scorer (RewardScorer,
check, overlong_penalty, pass_at_k). Every module imports numpy and the standard library
only (math-verify/sympy load on first use), never JAX: the reward workers import this
package.
"""

from epgrpo_jax.rewards.answers import (Gold, extract_answer, extract_boxed, light_normalise, parse_gold,
                                        prepare)
from epgrpo_jax.rewards.config import FALLBACKS, STATUSES, RewardConfig, RewardResult
from epgrpo_jax.rewards.custom import custom_rewards, resolve_reward_function
from epgrpo_jax.rewards.pool import CheckPool
from epgrpo_jax.rewards.scorer import RewardScorer, check, check_stats, overlong_penalty, pass_at_k
from epgrpo_jax.rewards.verify import DEFAULT_CHECKER, verify_prepared

