// Type-checks `highwater/tanstack-db` as an app uses it: a typed collection and a live query.
import { createCollection, createLiveQueryCollection, eq } from "@tanstack/db";
import { HighwaterClient } from "highwater";
import { highwaterCollectionOptions } from "highwater/tanstack-db";

interface Todo {
  id: number;
  owner: string;
  done: boolean;
}

export async function openTodos(client: HighwaterClient, owner: string): Promise<Todo[]> {
  const todos = createCollection(
    highwaterCollectionOptions<Todo, number>({
      client,
      scope: { resourceType: "todos", conditions: { owner } },
      getKey: (todo) => todo.id,
    }),
  );
  const done = createLiveQueryCollection((q) => q.from({ todo: todos }).where(({ todo }) => eq(todo.done, true)));
  await done.preload();
  const problem: string | undefined = todos.utils.error()?.code;
  console.log(problem);
  return [...done.values()];
}
