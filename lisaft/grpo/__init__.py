"""GRPO (online RL on verifiable rewards), the parts below the trainer: rewards, advantages, the
loss, sampling on the policy, and one generation batch (rollout.py); the objective the trainer
calls is lisaft/train/objectives/grpo.py. docs/grpo.md says what each follows of TRL 1.16."""
