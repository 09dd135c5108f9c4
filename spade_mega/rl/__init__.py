"""GRPO for both SPADE roles: per-role advantages, the policy loss with truncated IS, the delayed designer buffer."""
