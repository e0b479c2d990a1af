"""ms-swift 4.x: the adapter (:mod:`.adapter`), which templates read their model while
they encode (:mod:`.templates`), what each template decodes through
(:mod:`.coverage`), ``swift infer`` / ``deploy`` / ``export`` (:mod:`.inference`,
:mod:`.serving`, with the addresses a request's media URL may reach: :mod:`.url_policy`) and
GRPO rollouts (:mod:`.rollouts`)."""
