"""``mindspeed-tp rl-check``: a true on-policy GRPO loop end to end. Each iteration an engine (the
bundled reference engine or the real vLLM) samples P prompts x G responses, a verifiable reward
scores them, verl's GRPO advantage and clipped policy loss train the policy through megatron-core's
DDP, optimizer and schedules at a training layout other than the engine's, and the new weights go
to the running engine in memory. What it measures: the training forward's logprobs of every
response token against the engine's (the importance ratio the loss sees).

``main.py`` flags and the torchrun entry, ``task.py`` the bundled reward, ``grpo.py`` verl's
advantage and loss, ``engines.py`` the rollout engines and their weight sync, ``weights.py`` the
full weights of a model in any layout, ``step.py`` the forward-only logprob pass and the training
step, ``loop.py`` the iterations of one arm, ``report.py`` table, JSON and plot."""
