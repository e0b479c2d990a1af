"""LeRobot 0.4-0.6: the adapter (:mod:`.adapter`), the target table of each LeRobot
layout (:mod:`.layouts`), every decode in the sandbox (:mod:`.decode`),
skip-and-substitute (:mod:`.substitute`) and the workers' start method and run
summary (:mod:`.workers`)."""
