"""GraphQL that the Dagster UI sends, taken from the installed dagster-webserver, and the mutations the
scale benchmark drives the deployment with.

The UI's queries are read from the webserver's JavaScript bundle at run time (each is a template
literal there, with the fragments it spreads defined in other literals), so the benchmark times
exactly what the installed UI asks, whatever its version.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

# The pages timed, and their queries (names as in the bundle).
UI_QUERIES = {
    "asset partitions page": "PartitionHealthQuery",
    "asset check partitions": "AssetCheckPartitionHealthQuery",
    "backfill page": "BackfillDetailsQuery",
    "asset page (definition)": "AssetViewDefinitionQuery",
    "asset page (live data)": "AssetGraphLiveQuery",
}
_LITERAL = re.compile(r'\(\[((?:"(?:[^"\\]|\\.)*",?)+)\]\)')  # a compiled template literal: (["..", ".."])
_DEFINITION = re.compile(r"(?m)^\s*(query|fragment|mutation|subscription) (\w+)")


def _bundle_text() -> str:
    import dagster_webserver

    build = Path(dagster_webserver.__file__).parent / "webapp" / "build"
    return "\n".join(path.read_text(errors="replace") for path in sorted(build.rglob("*.js")))


@cache
def ui_definitions() -> dict[str, str]:
    """Every query and fragment definition in the UI bundle, by name."""
    found: dict[str, str] = {}
    for literal in _LITERAL.finditer(_bundle_text()):
        try:
            text = "".join(json.loads(f"[{literal.group(1).rstrip(',')}]"))
        except ValueError:
            continue
        starts = [(m.start(), m.group(2)) for m in _DEFINITION.finditer(text)]
        for i, (start, name) in enumerate(starts):
            end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
            found.setdefault(name, text[start:end].strip())
    return found


def ui_query(name: str) -> str:
    """The query `name` with every fragment it needs, as the UI sends it."""
    definitions = ui_definitions()
    if name not in definitions:
        raise LookupError(f"query {name} is not in the installed dagster-webserver's UI bundle")
    parts, seen, todo = [definitions[name]], set(), _spreads(definitions[name])
    while todo:
        fragment = todo.pop()
        if fragment in seen:
            continue
        seen.add(fragment)
        parts.append(definitions[fragment])
        todo += _spreads(definitions[fragment])
    return "\n".join(parts)


def _spreads(text: str) -> list[str]:
    return sorted(set(re.findall(r"\.\.\.(\w+)", text)) - {"on"})


REPOSITORY_FIELDS = "repositoryName: $repositoryName, repositoryLocationName: $location"
START_SENSOR = f"""
mutation StartSensor($repositoryName: String!, $location: String!, $name: String!) {{
  startSensor(sensorSelector: {{{REPOSITORY_FIELDS}, sensorName: $name}}) {{
    __typename ... on Sensor {{ id }} ... on PythonError {{ message }}
  }}
}}
"""
STOP_SENSOR_STATE = f"""
query SensorState($repositoryName: String!, $location: String!, $name: String!) {{
  sensorOrError(sensorSelector: {{{REPOSITORY_FIELDS}, sensorName: $name}}) {{
    __typename ... on Sensor {{ sensorState {{ id selectorId }} }}
  }}
}}
"""
STOP_SENSOR = """
mutation StopSensor($id: String!) {
  stopSensor(id: $id) { __typename ... on StopSensorMutationResult { instigationState { status } } }
}
"""
SCHEDULE_STATE = f"""
query ScheduleState($repositoryName: String!, $location: String!, $name: String!) {{
  scheduleOrError(scheduleSelector: {{{REPOSITORY_FIELDS}, scheduleName: $name}}) {{
    __typename ... on Schedule {{ scheduleState {{ id }} }}
  }}
}}
"""
STOP_SCHEDULE = """
mutation StopSchedule($id: String!) {
  stopRunningSchedule(id: $id) { __typename ... on PythonError { message } }
}
"""
CANCEL_BACKFILL = """
mutation CancelBackfill($backfillId: String!) {
  cancelPartitionBackfill(backfillId: $backfillId) { __typename ... on PythonError { message } }
}
"""
