"""ms-swift 4.x: the adapter (:mod:`.adapter`), which templates read their model while
they encode (:mod:`.templates`), what each template decodes through
(:mod:`.coverage`), ``swift infer`` / ``deploy`` / ``export`` (:mod:`.inference`,
:mod:`.serving`) and GRPO rollouts (:mod:`.rollouts`)."""
