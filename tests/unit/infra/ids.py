"""Home ids for the local infra's tests: fresh for each test process, since parallel workers
(pytest-xdist) run these tests at once and a home's sweep stops every process and cgroup
that carries its id."""

from __future__ import annotations

import uuid

HOME_A = uuid.uuid4().hex[:12]
HOME_B = uuid.uuid4().hex[:12]
HOME_C = uuid.uuid4().hex[:4]
HOME_D = uuid.uuid4().hex[:4]
