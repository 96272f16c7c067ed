"""Ask a run's model something: `workbench generate RUN --prompt TEXT`, `workbench.generate(run, prompt)`, the
Studio's Try tab.

    import workbench
    print(workbench.generate("20261206-101500-ab12", "What is a mixture of experts?", temperature=0))
    for piece in workbench.generate_stream(run, prompt):  # the same reply, token by token
        print(piece, end="", flush=True)

A run is named by its folder or its id in the runs directory; its latest weights answer (its hf/ export,
else its newest step-* checkpoint: workbench.generation.run_weights), full or LoRA, on one process.
`workbench.generation.api.load(run)` keeps a run's model loaded for several prompts (what the Studio does).
"""
