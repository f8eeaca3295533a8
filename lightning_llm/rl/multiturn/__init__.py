"""Multi-turn rollouts (``--model.env``, ``--model.tools``): the environment contract (:mod:`.env`), tool calls
(:mod:`.tools`), turns rendered with the chat template (:mod:`.turns`), episodes decoded turn by turn
(:mod:`.episodes`), and the online RL tasks' side of them (:mod:`.multi_turn`)."""
