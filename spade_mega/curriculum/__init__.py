"""The curriculum: corpus grounding, environment memory, skills, designer prompts, rewards."""
