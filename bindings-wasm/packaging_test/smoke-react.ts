// Type-checks `highwater/react` as a React app uses it: typed rows from a generic hook.
import { HighwaterClient } from "highwater";
import { useScope, type ScopeState } from "highwater/react";

interface Todo {
  id: string;
  title: string;
  done: boolean;
}

export function useTodos(client: HighwaterClient, owner: string | null): ScopeState<Todo> {
  return useScope<Todo>(client, owner === null ? null : { resourceType: "todos", conditions: { owner } });
}

export function titles(state: ScopeState<Todo>): string[] {
  const open: readonly Todo[] = state.rows.filter((todo) => !todo.done);
  const waiting: boolean = !state.ready && state.status.state !== "closed";
  return waiting ? [] : open.map((todo) => todo.title);
}
