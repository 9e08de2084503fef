/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma;

/**
 * An error raised by the native shuffle engine, or by the JVM glue around it.
 *
 * <p>The native library throws this class (with a {@link #kind()}) from every {@link NativeBridge}
 * method that fails; the JVM side never classifies errors by message text, only by kind.
 * Kinds the JVM side knows (the native side may add more; unknown kinds are treated as
 * non-transient):
 * <ul>
 *   <li>{@code connect}, {@code timeout}, {@code io}, {@code closed} — transport trouble that a
 *       retry may cure; fetch failures of these kinds reach Spark as {@link java.io.IOException}
 *       so Spark's own fetch retries ({@code spark.shuffle.io.maxRetries}) apply;</li>
 *   <li>{@code not_found} — the server does not have the block (shuffle unregistered, map output
 *       never registered);</li>
 *   <li>{@code auth} — the peer failed {@code spark.authenticate} challenge-response;</li>
 *   <li>{@code protocol}, {@code too_large}, {@code config}, {@code internal} — bugs, limits or
 *       bad settings; the message names the limit and the setting to change.</li>
 * </ul>
 */
public class RdmaShuffleException extends RuntimeException {
  private static final long serialVersionUID = 1L;

  /** Kind used when the native side did not name one. */
  public static final String KIND_INTERNAL = "internal";

  private final String kind;

  /**
   * Creates an exception of a given kind.
   *
   * @param kind one of the kinds listed in the class documentation (null means "internal")
   * @param message what failed, with the context a user needs to act on it
   */
  public RdmaShuffleException(String kind, String message) {
    super(message);
    this.kind = kind == null ? KIND_INTERNAL : kind;
  }

  /**
   * Creates an exception of a given kind with a cause.
   *
   * @param kind one of the kinds listed in the class documentation (null means "internal")
   * @param message what failed
   * @param cause the underlying error
   */
  public RdmaShuffleException(String kind, String message, Throwable cause) {
    super(message, cause);
    this.kind = kind == null ? KIND_INTERNAL : kind;
  }

  /**
   * Constructor used by the native library, which only has a message at hand; the kind is
   * then "internal".
   *
   * @param message what failed
   */
  public RdmaShuffleException(String message) {
    this(KIND_INTERNAL, message);
  }

  /** @return the error kind (never null). */
  public String kind() {
    return kind;
  }

  /**
   * @return true for kinds a retry may cure (transport trouble), which Spark's retrying
   *     block transfer should see as an {@link java.io.IOException}.
   */
  public boolean isTransient() {
    return isTransientKind(kind);
  }

  /**
   * @param kind an error kind
   * @return whether that kind names transient transport trouble
   */
  public static boolean isTransientKind(String kind) {
    return "connect".equals(kind) || "timeout".equals(kind) || "io".equals(kind)
        || "closed".equals(kind);
  }

  @Override
  public String toString() {
    return getClass().getName() + "[" + kind + "]: " + getMessage();
  }
}
