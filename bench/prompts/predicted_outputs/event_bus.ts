// A typed publish/subscribe bus for UI events, with one-shot listeners and error isolation.

export type Listener<T> = (payload: T) => void | Promise<void>;

interface Subscription<T> {
  listener: Listener<T>;
  once: boolean;
}

export interface EventBusOptions {
  onError?: (event: string, error: unknown) => void;
  maxListeners?: number;
}

export class EventBus<Events extends Record<string, unknown>> {
  private readonly listeners = new Map<keyof Events, Subscription<any>[]>();
  private readonly onError: (event: string, error: unknown) => void;
  private readonly maxListeners: number;

  constructor(options: EventBusOptions = {}) {
    this.onError = options.onError ?? ((event, error) => console.error(`[${event}]`, error));
    this.maxListeners = options.maxListeners ?? 50;
  }

  subscribe<K extends keyof Events>(event: K, listener: Listener<Events[K]>): () => void {
    return this.add(event, listener, false);
  }

  subscribeOnce<K extends keyof Events>(event: K, listener: Listener<Events[K]>): () => void {
    return this.add(event, listener, true);
  }

  private add<K extends keyof Events>(
    event: K,
    listener: Listener<Events[K]>,
    once: boolean,
  ): () => void {
    const list = this.listeners.get(event) ?? [];
    if (list.length >= this.maxListeners) {
      throw new Error(`too many listeners for ${String(event)}`);
    }
    const subscription: Subscription<Events[K]> = { listener, once };
    list.push(subscription);
    this.listeners.set(event, list);
    return () => this.remove(event, subscription);
  }

  private remove<K extends keyof Events>(event: K, subscription: Subscription<Events[K]>): void {
    const list = this.listeners.get(event);
    if (!list) {
      return;
    }
    const index = list.indexOf(subscription);
    if (index >= 0) {
      list.splice(index, 1);
    }
    if (list.length === 0) {
      this.listeners.delete(event);
    }
  }

  async publish<K extends keyof Events>(event: K, payload: Events[K]): Promise<number> {
    const list = [...(this.listeners.get(event) ?? [])];
    let delivered = 0;
    for (const subscription of list) {
      if (subscription.once) {
        this.remove(event, subscription);
      }
      try {
        await subscription.listener(payload);
        delivered += 1;
      } catch (error) {
        this.onError(String(event), error);
      }
    }
    return delivered;
  }

  listenerCount<K extends keyof Events>(event: K): number {
    return this.listeners.get(event)?.length ?? 0;
  }

  clear(): void {
    this.listeners.clear();
  }
}

export type AppEvents = {
  "user:login": { userId: string; at: Date };
  "user:logout": { userId: string };
  "cart:update": { items: number; total: number };
};

export const bus = new EventBus<AppEvents>();
