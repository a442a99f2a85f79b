"""Run time: manifest + cubin cache, module loading and launches, op dispatch (cuda and reference
backends), and (later) memory, models, scheduler and sampling. Never imports codegen."""
