"""Configs of the preference family: MADPO, MARLHF and their iterative variants (CoMLRL 1.4.3's
fields and defaults, plus the settings every comlrl trainer shares)."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

from ...engine.config import (Config, check_bool, check_choice, check_float, check_int, check_str, config_class,
                              optional, setting)
from ...engine.settings import Devices, TrainerConfig, check_devices
from ...exceptions import ConfigError
from .comparators import HTTP_EXTRA

__all__ = ["MADPOConfig", "MARLHFConfig", "MADPOIterConfig", "MARLHFIterConfig", "RL_ALGORITHMS",
           "COMPARATOR_POLICIES", "REPLAY_MODES"]

logger = logging.getLogger("comlrl")

MAGRPO_FAMILY = {"magrpo": "mean", "mareinforce": "raw", "maremax": "max", "marloo": "rloo"}
RL_ALGORITHMS = tuple(MAGRPO_FAMILY) + ("maac", "iac")
COMPARATOR_POLICIES = ("current", "current_copy", "model", "history", "api")
REPLAY_MODES = ("current", "nearest_k", "all_history", "lambda_decay")
_positive = check_float(lambda v: v > 0, "> 0")


@config_class
class MADPOConfig(TrainerConfig):
    """Multi-agent DPO: candidates per prompt are scored by the task reward, pairs of joint answers
    chosen, and each agent trained with the DPO loss of the joint preference."""

    num_turns: int = setting(1, "Turns per episode; the preference trainers support 1.", check_int(1))
    early_termination_threshold: Optional[float] = setting(None, "Unused with one turn (CoMLRL's default: None).",
                                                           optional(check_float(lambda v: True, "(finite)")))
    collaboration_mode: str = setting("decentralized", "'decentralized': one policy per agent; 'centralized': ONE "
                                                       "policy writes every role's part (tagged sections).",
                                      check_choice("decentralized", "centralized"))
    joint_mode: str = setting("aligned", "Candidate j of every agent forms joint candidate j ('aligned' only).",
                              check_choice("aligned", aliases={"align": "aligned"}))
    advantage_mode: str = setting("mean", "Baseline of a MAGRPO-family RL phase (MARLHF); set from rl_algorithm.",
                                  check_choice("mean", "raw", "max", "rloo"))
    preference_num_candidates: int = setting(80, "Candidates each agent samples per prompt (>= 2).", check_int(2))
    preference_pairs_per_sample: Optional[int] = setting(16, "Pairs kept per prompt (None: all); must be None with "
                                                             "pair_selection='all'.", optional(check_int(1)))
    pair_selection: str = setting("reward_gap", "Which pairs of a prompt's candidates to keep: 'reward_gap' (largest "
                                                "first), 'all', 'random'.", check_str)
    dpo_beta: float = setting(0.1, "DPO temperature beta (> 0).", _positive)
    use_environment_step: bool = setting(True, "Count environment_steps_per_pair env steps per trained pair (else "
                                               "one per pair).", check_bool)
    environment_steps_per_pair: int = setting(2, "env_step advance per trained pair (a pair is two joint answers).",
                                              check_int(1))
    # --- comlrl's own ---------------------------------------------------------------------------
    dpo_reference: str = setting("policy", "'policy': DPO against the policy that generated the pairs (its "
                                           "log-probs computed once per pair set); 'none': CoMLRL 1.4.3's "
                                           "reference-free loss.", check_choice("policy", "none"))

    def _check_generations(self) -> None:
        """Candidates come from preference_num_candidates; num_generations is a MARLHF setting."""

    def _pair_selections(self) -> tuple[str, ...]:
        return ("reward_gap", "all", "random")

    def validate(self) -> None:
        super().validate()
        if self.num_turns != 1:
            raise ConfigError(f"{type(self).__name__} supports num_turns=1 only (preferences between single "
                              f"answers), got num_turns={self.num_turns}.")
        mode = str(self.pair_selection or "reward_gap").strip().lower()
        if mode not in self._pair_selections():
            raise ConfigError(f"pair_selection must be one of: {', '.join(self._pair_selections())}; got "
                              f"{self.pair_selection!r}.")
        object.__setattr__(self, "pair_selection", mode)
        if mode == "all" and self.preference_pairs_per_sample is not None:
            raise ConfigError("preference_pairs_per_sample must be None (null) when pair_selection='all' (every pair "
                              "is kept).")
        if self.collaboration_mode == "centralized" and getattr(self, "comparator_centralized_agent_index", 0) != 0:
            raise ConfigError("Centralized collaboration has only actor index 0: set comparator_centralized_agent_index"
                              "=0.")

    def _actor_count(self) -> int:
        return 1 if self.collaboration_mode == "centralized" else self.num_agents


_rl_algorithm = check_choice(*RL_ALGORITHMS, aliases={"mareforce": "mareinforce"}, none_is="magrpo")


@config_class
class MARLHFConfig(MADPOConfig):
    """Multi-agent RLHF: a joint reward model is trained on preference pairs, then frozen and used
    as the reward of an online phase with the trainer ``rl_algorithm`` names."""

    rl_algorithm: str = setting("magrpo", "The online phase: magrpo, mareinforce, maremax, marloo (group baselines) "
                                          "or maac, iac (critics).", _rl_algorithm)
    num_generations: int = setting(4, "Completions per prompt in the online phase (>= 2 for the MAGRPO family).",
                                   check_int(1))
    reward_model_name: Optional[str] = setting(None, "Backbone of the reward model (a name or path); None: the agents' "
                                                     "model (a copy of the first agent's initial weights).",
                                               optional(check_str))
    reward_model_device: Optional[str] = setting("cuda:0", "Device of the reward model; the default 'cuda:0' falls "
                                                           "back to the agents' device without CUDA.",
                                                 lambda name, v: None if v is None else str(v), may_change=True)
    reward_learning_rate: float = setting(1.0e-5, "AdamW learning rate of the reward model.", _positive)
    reward_num_train_epochs: int = setting(1, "Epochs of reward-model training over the pairs.", check_int(1))
    reward_train_batch_size: int = setting(1, "Pairs per reward-model optimizer step.", check_int(1))
    reward_max_length: Optional[int] = setting(None, "Truncate reward-model inputs to this many tokens (keeping "
                                                     "their end); None: the backbone's context.", optional(check_int(1)))
    reward_freeze_backbone: bool = setting(False, "Train only the reward head.", check_bool)
    critic_model_name: Optional[str] = setting(None, "Critic of a maac / iac online phase (None: the agents' model).",
                                               optional(check_str))
    critic_learning_rate: Optional[float] = setting(None, "Critic learning rate (None: agent_learning_rate).",
                                                    optional(_positive))
    critic_devices: Devices = setting(None, "Devices of the critics (maac / iac).", check_devices, may_change=True)
    use_separate_critic: bool = setting(True, "iac: a separate critic per agent (else a value head).", check_bool)
    critic_type: str = setting("v", "Critic of maac / iac: 'v' or 'q'.", check_choice("v", "q"))
    value_loss_coef: float = setting(0.6, "Weight of the critics' value loss (maac / iac).", _positive)
    value_clip_range: Optional[float] = setting(0.2, "iac value clipping (None: off).", optional(_positive))
    critic_value_head_hidden_dim: Optional[int] = setting(None, "Hidden width of the critics' value heads.",
                                                          optional(check_int(0)))
    value_head_hidden_dim: Optional[int] = setting(None, "Hidden width of the agents' value heads (iac without "
                                                         "separate critics).", optional(check_int(0)))

    def __post_init__(self) -> None:
        algorithm = _rl_algorithm("rl_algorithm", self.rl_algorithm)
        if algorithm in MAGRPO_FAMILY:  # CoMLRL: the algorithm decides the baseline
            object.__setattr__(self, "advantage_mode", MAGRPO_FAMILY[algorithm])
        super().__post_init__()

    def validate(self) -> None:
        super().validate()
        if self.rl_algorithm in MAGRPO_FAMILY and self.num_generations < 2:
            raise ConfigError(f"num_generations must be >= 2 for the MAGRPO-family online phase (rl_algorithm="
                              f"{self.rl_algorithm!r} compares a completion with its group), got {self.num_generations}.")
        if self.rl_algorithm in MAGRPO_FAMILY and self.advantage_mode != MAGRPO_FAMILY[self.rl_algorithm]:
            raise ConfigError(f"advantage_mode={self.advantage_mode!r} contradicts rl_algorithm={self.rl_algorithm!r} "
                              f"(which uses {MAGRPO_FAMILY[self.rl_algorithm]!r}); change rl_algorithm instead.")


_replay_mode = check_choice(*REPLAY_MODES, none_is="current", aliases={
    "latest": "current", "new": "current", "recent_k": "nearest_k", "last_k": "nearest_k", "k": "nearest_k",
    "lambda": "lambda_decay", "td_lambda": "lambda_decay", "td-lambda": "lambda_decay"})
_comparator_policy = check_choice(*COMPARATOR_POLICIES, none_is="current", aliases={
    "self": "current", "online": "current", "copy": "current_copy", "online_copy": "current_copy",
    "current-offload": "current_copy", "current_offload": "current_copy", "external": "model",
    "comparator": "model", "reference": "model", "ref": "model", "checkpoint": "history",
    "previous": "history", "previous_iteration": "history", "http": "api", "endpoint": "api"})
_generation_mode = check_choice("decentralized", "centralized", none_is="decentralized", aliases={
    "decentralised": "decentralized", "multi_agent": "decentralized", "multi-agent": "decentralized",
    "centralised": "centralized", "single_agent": "centralized", "single-agent": "centralized"})


def _api_url(name: str, value: Any) -> str:
    url = check_str(name, value)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{name} must be an http:// or https:// URL with a host, got {url!r}.")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{name} must not hold credentials (user:password@); set comparator_api_key_env to the "
                          "name of an environment variable holding the key.")
    return url


def _headers(name: str, value: Any) -> Optional[dict]:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(f"{name} must be a dict of header names to strings, got {value!r:.80}.")
    if any(k.strip().lower() in ("authorization", "x-api-key", "api-key") for k in value):
        raise ConfigError(f"{name} must not carry the API key (it would be saved with the config); set "
                          "comparator_api_key_env to the name of an environment variable holding it.")
    return value


@config_class
class _IterativeFields(Config):
    """The iterative variants' settings: iterations, comparators, replay, plots."""

    num_iterations: int = setting(6, "Iterations of generate / compare / train in the WHOLE run; resuming with a "
                                     "larger value extends it.", check_int(1), may_change=True)
    preference_replay_mode: str = setting("current", "Pairs trained on in an iteration: 'current' (this "
                                                     "iteration's), 'nearest_k', 'all_history', 'lambda_decay'.",
                                          _replay_mode)
    preference_replay_k: Optional[int] = setting(None, "nearest_k: replay from the newest k iterations.",
                                                 optional(check_int(1)))
    preference_replay_lambda: Optional[float] = setting(None, "lambda_decay: weight decay per iteration of age, in "
                                                              "[0, 1].", optional(check_float(lambda v: 0 <= v <= 1,
                                                                                              "in [0, 1]")))
    preference_replay_sample_size: Optional[int] = setting(None, "Replayed pairs per iteration (None: as many as the "
                                                                 "iteration generated).", optional(check_int(1)))
    preference_replay_dir: Optional[str] = setting(None, "Where each iteration's pairs are written as JSONL (None: "
                                                         "beside the checkpoints / metrics).", optional(check_str),
                                                   may_change=True)
    log_reward_distribution: bool = setting(False, "Plot each iteration's candidate and selected reward "
                                                   "distributions (PNG, matplotlib); needs reward_func.reward_range.",
                                            check_bool, may_change=True)
    policy_checkpoint_dir: Optional[str] = setting(None, "Save the agents after every iteration (transformers "
                                                         "folders); also where comparator_policy='history' reads.",
                                                   optional(check_str), may_change=True)
    comparator_policy: str = setting("current", "Who the current policy is compared with: 'current' (itself, "
                                                "independent samples), 'current_copy', 'model', 'history', 'api'.",
                                     _comparator_policy)
    comparator_generation_mode: str = setting("decentralized", "'centralized': one comparator model writes every "
                                                               "agent's part (tagged sections).", _generation_mode)
    comparator_centralized_agent_index: int = setting(0, "Which agent (or comparator model) writes the centralized "
                                                         "comparator's answers.", check_int(0))
    comparator_model_name: Optional[str] = setting(None, "comparator_policy='model': one model name for every agent.",
                                                   optional(check_str))
    comparator_agents: Optional[Sequence[str]] = setting(None, "comparator_policy='model': one model name per agent.",
                                                         None)
    comparator_devices: Devices = setting(None, "Devices of comparator models (None: the agents').", check_devices,
                                          may_change=True)
    comparator_num_candidates: Optional[int] = setting(None, "Comparator candidates per prompt (None: "
                                                             "preference_num_candidates).", optional(check_int(1)))
    comparator_history_k: Optional[int] = setting(None, "comparator_policy='history': compare with the policy from k "
                                                        "iterations ago (default 1).", optional(check_int(1)))
    comparator_api_url: Optional[str] = setting(None, "comparator_policy='api': the endpoint URL (http or https, no "
                                                      "credentials in it).", optional(_api_url), may_change=True)
    comparator_api_format: str = setting("generic", "'generic' (comlrl/CoMLRL JSON), 'openai' (chat completions), "
                                                    "'anthropic' (messages), 'openai_responses'.",
                                         check_choice("generic", "openai", "anthropic", "openai_responses",
                                                      aliases={"openai_chat": "openai", "chat": "openai",
                                                               "anthropic_messages": "anthropic",
                                                               "messages": "anthropic", "responses": "openai_responses",
                                                               "codex": "openai_responses"}))
    comparator_api_model: Optional[str] = setting(None, "The model name sent to the API.", optional(check_str))
    comparator_api_max_n_per_request: Optional[int] = setting(None, "Candidates asked for per request (None: all in "
                                                                    "one where the format allows).",
                                                              optional(check_int(1)), may_change=True)
    comparator_api_timeout: float = setting(120.0, "Seconds one whole request may take (connecting, sending and "
                                                   "reading the whole reply) before it is retried.", _positive,
                                            may_change=True)
    comparator_api_headers: Optional[dict] = setting(None, "Extra HTTP headers (not the key).", _headers,
                                                     may_change=True)
    comparator_api_key: Optional[str] = setting(None, "The API key itself (discouraged: use comparator_api_key_env). "
                                                      "Never saved, logged or sent to trackers.", optional(check_str),
                                                may_change=True, secret=True)
    comparator_api_key_env: Optional[str] = setting(None, "Name of the environment variable holding the API key.",
                                                    optional(check_str), may_change=True)
    comparator_api_key_header: str = setting("Authorization", "Header that carries the key.", check_str,
                                             may_change=True)
    comparator_api_key_prefix: str = setting("Bearer", "Prefix of the key in that header ('' for none).",
                                             lambda name, v: "" if v is None else str(v), may_change=True)
    comparator_api_response_field: str = setting("completions", "generic format: the (dotted) field of the response "
                                                                "holding the completions.", check_str)
    comparator_api_extra_body: Optional[dict] = setting(None, "More JSON fields of every request body.", None)
    # --- comlrl's own ---------------------------------------------------------------------------
    comparator_api_retries: int = setting(2, "Retries of a failed API request (timeouts, broken or malformed replies, "
                                             "429, 5xx), with backoff.", check_int(0), may_change=True)
    comparator_api_max_response_bytes: int = setting(16 * 2**20, "Largest API reply read, in bytes; a larger one "
                                                                 "stops training with ComparatorError.",
                                                     check_int(1024), may_change=True)

    def validate(self) -> None:
        super().validate()
        if self.collaboration_mode == "centralized":
            object.__setattr__(self, "comparator_generation_mode", "centralized")
        if self.comparator_generation_mode == "centralized" and \
                self.comparator_centralized_agent_index >= self.num_agents:
            raise ConfigError(f"comparator_centralized_agent_index must be smaller than num_agents ({self.num_agents}), "
                              f"got {self.comparator_centralized_agent_index}.")
        self._check_replay()
        self._check_comparator()

    def _check_replay(self) -> None:
        mode, k, lam = self.preference_replay_mode, self.preference_replay_k, self.preference_replay_lambda
        if mode == "current":
            if k not in (None, 1):
                raise ConfigError("preference_replay_k must be None or 1 when preference_replay_mode='current'.")
            if self.preference_replay_sample_size is not None:
                raise ConfigError("preference_replay_sample_size is only valid when preference_replay_mode is "
                                  "'nearest_k', 'all_history', or 'lambda_decay'.")
        if mode == "nearest_k" and k is None:
            raise ConfigError("preference_replay_k is required when preference_replay_mode='nearest_k'.")
        if mode in ("all_history", "lambda_decay") and k is not None:
            raise ConfigError("preference_replay_k is only valid when preference_replay_mode='nearest_k'.")
        if mode == "lambda_decay" and lam is None:
            raise ConfigError("preference_replay_lambda is required when preference_replay_mode='lambda_decay'.")
        if mode != "lambda_decay" and lam is not None:
            raise ConfigError("preference_replay_lambda is only valid when preference_replay_mode='lambda_decay'.")

    def _check_comparator(self) -> None:
        policy = self.comparator_policy
        if self.comparator_agents is not None and (isinstance(self.comparator_agents, str) or not all(
                isinstance(a, str) for a in self.comparator_agents)):
            raise ConfigError(f"comparator_agents must be a list of model names, got {self.comparator_agents!r:.80}.")
        if policy == "model" and self.comparator_model_name is None and self.comparator_agents is None:
            raise ConfigError("comparator_model_name or comparator_agents is required when comparator_policy='model'.")
        if policy not in ("model", "api") and (self.comparator_model_name or self.comparator_agents):
            raise ConfigError("comparator_model_name and comparator_agents are only valid when comparator_policy="
                              "'model'.")
        if policy != "history" and self.comparator_history_k is not None:
            raise ConfigError("comparator_history_k is only valid when comparator_policy='history'.")
        if policy == "api" and not self.comparator_api_url:
            raise ConfigError("comparator_api_url is required when comparator_policy='api'.")
        if policy == "api" and importlib.util.find_spec("httpx") is None:
            raise ConfigError(f"comparator_policy='api' talks HTTP through httpx, which is not installed: {HTTP_EXTRA}.")
        if self.comparator_api_key is not None:
            logger.warning("comlrl: comparator_api_key is set in the config; it is never saved or logged, but prefer "
                           "comparator_api_key_env (the name of an environment variable holding the key).")

    def _pair_selections(self) -> tuple[str, ...]:
        return ("reward_gap", "all", "random", "comparator_reward")


@config_class
class MADPOIterConfig(_IterativeFields, MADPOConfig):
    """Iterative MADPO: every iteration generates new pairs of the current policy against a
    comparator, (optionally) replays earlier iterations' pairs, and trains num_train_epochs on them."""

    num_train_epochs: int = setting(1, "DPO epochs per iteration.", check_int(1), may_change=True)
    preference_num_candidates: int = setting(20, "Current-policy candidates per prompt and iteration.", check_int(1))
    preference_pairs_per_sample: Optional[int] = setting(4, "Pairs kept per prompt (None: all).",
                                                         optional(check_int(1)))
    pair_selection: str = setting("comparator_reward", "'comparator_reward' (best comparator answers first), "
                                                       "'reward_gap', 'all', 'random'.", check_str)


@config_class
class MARLHFIterConfig(_IterativeFields, MARLHFConfig):
    """Iterative MARLHF: every iteration generates pairs against a comparator, retrains the reward
    model on them (and replayed pairs) and runs the online phase with it."""

    num_train_epochs: int = setting(2, "Online-phase epochs per iteration.", check_int(1), may_change=True)
    preference_num_candidates: int = setting(20, "Current-policy candidates per prompt and iteration.", check_int(1))
    preference_pairs_per_sample: Optional[int] = setting(4, "Pairs kept per prompt (None: all).",
                                                         optional(check_int(1)))
    pair_selection: str = setting("comparator_reward", "'comparator_reward', 'reward_gap', 'all', 'random'.",
                                  check_str)
    reward_num_train_epochs: int = setting(2, "Reward-model epochs per iteration.", check_int(1))
    preference_scoring_reward: str = setting("task", "Who scores candidates for new pairs: 'task' (reward_func) or "
                                                     "'reward_model' (the previous iteration's reward model).",
                                             check_choice("task", "reward_model",
                                                          aliases={"oracle": "task", "environment": "task",
                                                                   "env": "task", "model": "reward_model",
                                                                   "learned": "reward_model"}))

