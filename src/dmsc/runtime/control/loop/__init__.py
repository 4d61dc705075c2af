"""The control loop: every few seconds (``dmsc up --control-interval``), one snapshot of what
the control plane measured, the functional modules and the user's objectives run on it, and the
orchestrator's decisions are applied (``--control act``) or only proposed (``advise``); every
decision is a row and a log line, every broken objective an alert.

- :mod:`.objectives`: the policy a user sets (a policy file or flags): the service-level
  objectives, the action a breach asks for, the webhook, the decision rule's settings;
- :mod:`.tick`: one tick as a pure function over a snapshot: the objectives checked, the
  modules' proposals decided, what is new to record;
- :mod:`.busy`: a stage's node busy over the policy's threshold, tick after tick: path
  optimisation may move the stage away, and the loop a stage replica to an idle node of its
  datacenter (``move-node``);
- :mod:`.hysteresis`: the rules that keep moves steady: confirmed over consecutive ticks,
  judged on measurements of the current placement, a cool-down for a stage just moved;
- :mod:`.snapshot`: the snapshot read from the database and the control plane;
- :mod:`.resizing`: proposals to grow or shrink training's data-parallel degree, when devices
  go or come back or the policy's ``elastic`` asks (applied through :mod:`..training.resize`);
- :mod:`.moves`: an accepted move applied to the deployment (``dmsc replan`` applies with it too);
- :mod:`.symptoms`: alerts from the logs: a line that shows a failure (out of memory, NCCL or
  gloo errors, a checkpoint error) raises one;
- :mod:`.recoveries`: alerts for the workers the runtime replaced (a lost device or worker),
  each with a decision row that notes it;
- :mod:`.webhook`: alerts posted to the policy's webhook from a thread of their own, retried;
- :mod:`.runner`: the thread that ticks, records decisions and alerts, acts, and measures its
  own cost;
- :mod:`.views`: the loop as ``dmsc up`` starts it and as ``dmsc status`` and the dashboard
  show it.

Imports run one way: ``views -> runner -> snapshot -> tick -> resizing -> objectives``,
``tick -> hysteresis``, ``tick -> busy -> objectives``, ``snapshot, moves -> busy``,
``runner -> moves, webhook, hysteresis, symptoms, recoveries``.
Below it: :mod:`..advisors` (the modules and the decision rule) and :mod:`..tasks` (the
exception queue, through :mod:`..advisors.policy`).
"""
