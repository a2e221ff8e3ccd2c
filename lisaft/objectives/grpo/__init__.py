"""GRPO (online RL on verifiable rewards): the rewards, the advantages, the loss and the sampling
of completions on the policy; docs/grpo.md says what each follows of TRL 1.16."""
