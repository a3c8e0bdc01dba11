"""AFD role workers. `roles` holds the platform-neutral role logic (connector set-up, the
step wrapper on the attention model, the FFN serving thread) and `attention_runner` the
model-runner overrides every platform's attention runner mixes in; each platform's worker
module binds them to that platform's vLLM classes. `selection` maps a role and platform to
a worker class."""

from afd_core.spawn import force_spawn_multiprocessing_if_requested

# Runtimes that import a worker class directly (Ascend workers do) never run the entry
# point; the opt-in spawn override must be in force before they start processes.
force_spawn_multiprocessing_if_requested()
