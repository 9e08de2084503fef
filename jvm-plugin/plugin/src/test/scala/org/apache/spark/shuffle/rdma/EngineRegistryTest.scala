/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.{
  ByteArrayInputStream,
  ByteArrayOutputStream,
  ObjectInputStream,
  ObjectOutputStream,
  ObjectStreamClass
}

import org.junit.Assert._
import org.junit.Test

import org.apache.spark.rpc.{RpcAddress, RpcCallContext}

class EngineRegistryTest {
  import EngineRegistryMessages._

  /** Captures what the endpoint replies. */
  private class CapturingContext extends RpcCallContext {
    @volatile var replies: List[Any] = Nil
    override def reply(response: Any): Unit = replies = replies :+ response
    override def sendFailure(e: Throwable): Unit = throw e
    override def senderAddress: RpcAddress = RpcAddress("127.0.0.1", 1)
  }

  /**
   * Java-deserializes `bytes` the way an executor's RpcEnv does: with a class loader that does
   * not see the plugin jar (it came with --jars, after the RpcEnv was created).
   */
  private def deserializeWithoutPlugin(bytes: Array[Byte]): AnyRef = {
    val in = new ObjectInputStream(new ByteArrayInputStream(bytes)) {
      override def resolveClass(desc: ObjectStreamClass): Class[_] = {
        if (desc.getName.startsWith("org.apache.spark.shuffle.rdma.")) {
          throw new ClassNotFoundException(desc.getName)
        }
        super.resolveClass(desc)
      }
    }
    try in.readObject()
    finally in.close()
  }

  private def serialize(o: Any): Array[Byte] = {
    val bytes = new ByteArrayOutputStream()
    val out = new ObjectOutputStream(bytes)
    out.writeObject(o)
    out.close()
    bytes.toByteArray
  }

  @Test
  def lookupRepliesAreReadableWithoutThePluginClasses(): Unit = {
    val endpoint = new EngineRegistryEndpoint(null)
    val ctx = new CapturingContext
    endpoint.receiveAndReply(ctx)(RegisterEngine("7", "10.0.0.7", 4242, "tcp"))
    endpoint.receiveAndReply(ctx)(LookupEngine("7"))
    endpoint.receiveAndReply(ctx)(LookupEngine("8"))
    val List(registered, known, unknown) = ctx.replies
    assertEquals(true, registered)
    assertEquals(Some(("10.0.0.7", 4242)), deserializeWithoutPlugin(serialize(known)))
    assertEquals(None, deserializeWithoutPlugin(serialize(unknown)))
  }

  @Test
  def theFilterRejectsPluginClasses(): Unit = {
    // Guards the test above: a reply holding a plugin class must not get through the filter.
    try {
      deserializeWithoutPlugin(serialize(Some(EngineAddress("h", 1))))
      fail("a plugin class was deserialized")
    } catch {
      case e: ClassNotFoundException => assertTrue(e.getMessage.contains("EngineAddress"))
    }
  }
}
